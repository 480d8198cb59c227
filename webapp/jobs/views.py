"""The lab's pages. Each view validates input, calls one service or selector, renders.

Every page needs a login; a user reaches only their own jobs, configs and models (staff
reach all), and anything else is a 404, so ids of other people's jobs reveal nothing.
"""

from __future__ import annotations

import csv
import json

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.http import (
    FileResponse,
    Http404,
    HttpResponse,
    HttpResponseBadRequest,
    StreamingHttpResponse,
)
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from rlcore.envs import ParamError, get_env_class, list_environments
from rlcore.types import jsonl_line
from webapp.jobs import presenters, selectors, services
from webapp.jobs.forms import (
    AuditForm,
    DeltaForm,
    EnvConfigForm,
    FlagForm,
    JobForm,
    ModelEntryForm,
    RolloutFilterForm,
)
from webapp.jobs.models import Job, ModelEntry, RolloutFlag, WorkerNode
from webapp.jobs.nodes import nodes_overview
from webapp.jobs.services import CONFIG_CLASSES
from webapp.jobs.validation import ids_from

ROLLOUTS_PER_PAGE = 50
# Models a judged env config's page checks for the judge's family.
MODELS_CHECKED = 200


@login_required
def home(request):
    return redirect("jobs:job_list")


# ---------------------------------------------------------------------------------------
# Environments


@login_required
def env_list(request):
    return render(
        request,
        "jobs/env_list.html",
        {
            "environments": list_environments(),
            "configs": selectors.env_configs_with_flags(request.user),
        },
    )


def _preview(env_name: str, params: dict, seed: int) -> tuple[list[dict], str]:
    try:
        return services.env_examples_preview(env_name=env_name, params=params, seed=seed), ""
    except ParamError as exc:
        return [], str(exc)


def _seed(request) -> int:
    try:
        return max(0, int(request.GET.get("seed", 0)))
    except ValueError:
        return 0


@login_required
def env_config_create(request, env_name: str):
    try:
        get_env_class(env_name)
    except KeyError:
        raise Http404(f"no environment named {env_name!r}") from None
    form = EnvConfigForm(request.POST or None, env_name=env_name)
    if request.method == "POST" and form.is_valid():
        try:
            config = services.env_config_save(
                owner=request.user,
                name=form.cleaned_data["name"],
                env_name=env_name,
                params=form.params(),
            )
        except (ValidationError, ParamError) as exc:
            form.add_service_error(
                exc if isinstance(exc, ValidationError) else ValidationError(str(exc))
            )
        else:
            messages.success(request, f"Saved environment config {config.name!r}.")
            return redirect(config)
    examples, preview_error = _preview(env_name, {}, _seed(request))
    return render(
        request,
        "jobs/env_config_form.html",
        {
            "form": form,
            "env_name": env_name,
            "examples": examples,
            "preview_error": preview_error,
            "judge": _judge_advice(request.user, env_name),
        },
    )


@login_required
@require_GET
def env_preview(request, env_name: str):
    """The examples the env config form's current parameters give (an HTML fragment the
    config page swaps into its preview); a parameter the env refuses is the error shown."""
    try:
        get_env_class(env_name)
    except KeyError:
        raise Http404(f"no environment named {env_name!r}") from None
    form = EnvConfigForm(
        {"name": "preview", **{k: v for k, v in request.GET.items() if k.startswith("param_")}},
        env_name=env_name,
    )
    if form.is_valid():
        examples, preview_error = _preview(env_name, form.params(), _seed(request))
    else:
        examples = []
        preview_error = "; ".join(
            f"{name.removeprefix('param_')}: {' '.join(errors)}"
            for name, errors in form.errors.items()
        )
    return render(
        request,
        "jobs/_env_preview.html",
        {"examples": examples, "preview_error": preview_error},
    )


@login_required
def env_config_edit(request, pk: int):
    config = get_object_or_404(selectors.env_configs_for_user(request.user), pk=pk)
    form = EnvConfigForm(request.POST or None, env_name=config.env_name, instance=config)
    if request.method == "POST" and form.is_valid():
        try:
            services.env_config_save(
                owner=config.owner,
                name=form.cleaned_data["name"],
                env_name=config.env_name,
                params=form.params(),
                env_config=config,
            )
        except ValidationError as exc:
            form.add_service_error(exc)
        else:
            messages.success(request, f"Saved environment config {config.name!r}.")
            return redirect(config)
    examples, preview_error = _preview(config.env_name, config.params, _seed(request))
    return render(
        request,
        "jobs/env_config_form.html",
        {
            "form": form,
            "env_name": config.env_name,
            "config": config,
            "examples": examples,
            "preview_error": preview_error,
            "judge": _judge_advice(request.user, config.env_name, config),
            "audit": selectors.last_audit(request.user, config),
            "flag_count": selectors.flagged_rollouts(
                selectors.env_config_flags(request.user, config)
            ),
        },
    )


def _judge_advice(user, env_name: str, config=None) -> dict | None:
    """For an env that scores with an LLM judge: its judge model, that model's family,
    and the user's models of the same family (a judge favours its own family's style)."""
    if not get_env_class(env_name).judge_params.get("model"):
        return None
    judge = services.judge_model_of(config) if config else ""
    family = services.model_family(judge) if judge else ""
    # The newest models only: a family read from weights on disk costs a file each.
    same = [
        entry
        for entry in selectors.models_for_user(user).filter(owner=user)[:MODELS_CHECKED]
        if family and services.model_entry_family(entry) == family
    ]
    return {"model": judge, "family": family, "same_family": same}


@login_required
@require_POST
def env_config_delete(request, pk: int):
    config = get_object_or_404(selectors.env_configs_for_user(request.user), pk=pk)
    config.delete()
    messages.success(request, f"Deleted environment config {config.name!r}.")
    return redirect("jobs:env_list")


# ---------------------------------------------------------------------------------------
# Models


@login_required
def model_list(request):
    form = ModelEntryForm(request.POST or None, initial={"kind": ModelEntry.Kind.TINY})
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            entry = services.model_create(
                owner=request.user,
                name=data["name"],
                kind=data["kind"],
                location=data["location"],
                base_url=data["base_url"],
                api_key=data["api_key"],
                generation=form.generation(),
            )
        except ValidationError as exc:
            form.add_service_error(exc)
        else:
            messages.success(request, f"Registered model {entry.name!r}.")
            return redirect("jobs:model_list")
    return render(
        request,
        "jobs/model_list.html",
        {
            "form": form,
            "models": selectors.models_for_user(request.user),
            "model_roots": services.shared_roots(),
        },
    )


@login_required
@require_POST
def model_delete(request, pk: int):
    entry = get_object_or_404(selectors.models_for_user(request.user), pk=pk)
    services.model_delete(model=entry)
    messages.success(request, f"Removed model {entry.name!r}.")
    return redirect("jobs:model_list")


# ---------------------------------------------------------------------------------------
# Jobs


@login_required
def job_list(request):
    jobs = selectors.jobs_for_user(request.user)
    status = request.GET.get("status", "")
    if status in Job.Status.values:
        jobs = jobs.filter(status=status)
    page = Paginator(jobs, 50).get_page(request.GET.get("page"))
    return render(
        request,
        "jobs/job_list.html",
        {"page": page, "status": status, "statuses": Job.Status.values},
    )


@login_required
def job_create(request):
    kind = request.POST.get("kind") or request.GET.get("kind") or "eval"
    if kind not in CONFIG_CLASSES:
        kind = "eval"
    # Links from other pages preselect a model ("Eval" on a checkpoint) or a dataset
    # ("Start SFT" on a synth job); the form checks either against the user's own.
    initial = {key: request.GET[key] for key in ("model", "dataset") if request.GET.get(key)}
    recipe = request.POST.get("recipe") or request.GET.get("recipe") or None
    try:
        form = JobForm(
            request.POST or None, kind=kind, user=request.user, recipe=recipe, initial=initial
        )
    except ValidationError as exc:  # a recipe the kind does not have
        return HttpResponseBadRequest(f"recipe: {exc.message_dict['recipe'][0]}")
    if request.method == "POST" and form.is_valid():
        try:
            job = services.job_create(
                owner=request.user,
                kind=kind,
                env_config=form.cleaned_data.get("env_config"),
                model=form.cleaned_data["model"],
                options=form.options(),
                overrides=form.cleaned_data["overrides"],
                recipe=form.recipe,
            )
        except (ValidationError, ParamError) as exc:
            form.add_service_error(
                exc if isinstance(exc, ValidationError) else ValidationError(str(exc))
            )
        else:
            messages.success(request, f"Queued {job.kind} job #{job.pk} on the {job.queue} queue.")
            warning = services.judge_family_warning(env_config=job.env_config, model=job.model)
            if warning:
                messages.warning(request, f"Judge: {warning}.")
            return redirect(job)
    return render(
        request,
        "jobs/job_form.html",
        {
            "form": form,
            "kind": kind,
            "kinds": list(CONFIG_CLASSES),
            "recipe": form.recipe,
            "recipes": services.recipe_choices(kind),
        },
    )


@login_required
def job_detail(request, pk: int):
    job = services.job_check_worker(job=selectors.job_for_user(request.user, pk))
    live = {
        "job": job.pk,
        "kind": job.kind,
        "status": job.status,
        "started": job.started.timestamp() if job.started else None,
        "created": job.created.timestamp(),
        "progress": job.progress_dict(),
        "active": job.is_active,
        "ws": f"/ws/jobs/{job.pk}/",
        "updates": reverse("api:job_updates", args=[job.pk]),
        "inspector": reverse("jobs:rollout_list", args=[job.pk]),
    }
    return render(
        request,
        "jobs/job_detail.html",
        {
            "job": job,
            "live": live,
            "tables": presenters.summary_tables(job.summary if job.kind == Job.Kind.EVAL else None),
            "synth": job.result if job.kind == Job.Kind.SYNTH and job.result else None,
            "report": (job.result or {}).get("report", ""),
            "checkpoints": job.current_checkpoints().select_related("model_entry"),
            "node": WorkerNode.objects.filter(name=job.worker).first() if job.worker else None,
            "config_json": json.dumps(job.config, indent=2, sort_keys=True),
            "result_json": json.dumps(job.result, indent=2, sort_keys=True) if job.result else "",
            "held_out": presenters.held_out_check(
                selectors.metric_series(job, names=["reward/mean"]).get("reward/mean", []),
                selectors.job_deltas(job).filter(status=Job.Status.SUCCEEDED).first(),
            )
            if job.kind == Job.Kind.RL
            else None,
            "deltas": selectors.job_deltas(job)[:5] if job.kind in ("sft", "rl") else [],
        },
    )


@login_required
@require_POST
def job_cancel(request, pk: int):
    job = selectors.job_for_user(request.user, pk)
    try:
        job = services.job_cancel(job=job)
    except ValidationError as exc:
        messages.error(request, exc.messages[0])
    else:
        messages.success(
            request,
            f"Job #{job.pk} cancelled."
            if job.status == Job.Status.CANCELLED
            else f"Job #{job.pk} will stop after its current step.",
        )
    return redirect(job)


class _Echo:
    def write(self, value):
        return value


@login_required
def job_metrics_csv(request, pk: int):
    job = selectors.job_for_user(request.user, pk)
    writer = csv.writer(_Echo())
    rows = (
        writer.writerow([m.step, m.name, repr(m.value), m.created.isoformat()])
        for m in selectors.metric_rows(job).iterator()
    )
    header = writer.writerow(["step", "name", "value", "created"])
    response = StreamingHttpResponse(
        (line for part in ([header], rows) for line in part), content_type="text/csv"
    )
    response["Content-Disposition"] = f'attachment; filename="job-{job.pk}-metrics.csv"'
    return response


# ---------------------------------------------------------------------------------------
# Compare runs


@login_required
def compare(request):
    jobs = selectors.jobs_for_user(request.user)
    chosen_ids = ids_from(request.GET.getlist("jobs"))
    chosen = list(jobs.filter(pk__in=chosen_ids))
    names = selectors.metric_names(chosen) if chosen else []
    metric = request.GET.get("metric") or (
        "reward/mean" if "reward/mean" in names else (names[0] if names else "")
    )
    series = [
        {
            "job": job.pk,
            "label": f"#{job.pk} {job.kind} {job.title}",
            "started": job.started.timestamp() if job.started else job.created.timestamp(),
            "url": reverse("api:job_metrics", args=[job.pk]),
        }
        for job in chosen
    ]
    return render(
        request,
        "jobs/compare.html",
        {
            "jobs": jobs[:200],
            "chosen_ids": chosen_ids,
            "names": names,
            "metric": metric,
            "compare": {"metric": metric, "series": series},
        },
    )


# ---------------------------------------------------------------------------------------
# Rollout inspector


def _filtered_rollouts(request, job):
    """(filter form, matching rollouts), or (form with errors, None)."""
    form = RolloutFilterForm(request.GET, facts=selectors.job_facts(job))
    if not form.is_valid():
        return form, None
    return form, selectors.rollouts_filtered(job, form.filters())


@login_required
def rollout_list(request, pk: int):
    job = selectors.job_for_user(request.user, pk)
    form, rows = _filtered_rollouts(request, job)
    page = Paginator(rows if rows is not None else job.rollouts.none(), ROLLOUTS_PER_PAGE).get_page(
        request.GET.get("page")
    )
    query = request.GET.copy()
    query.pop("page", None)
    return render(
        request,
        "jobs/rollout_list.html",
        {
            "job": job,
            "form": form,
            "page": page,
            "facts": form.facts,
            "rows": [
                (rollout, presenters.fact_rows(form.facts, rollout.facts))
                for rollout in page.object_list
            ],
            "reward_names": selectors.rollout_reward_names(job, page.object_list),
            "outcomes": selectors.rollout_outcomes(job),
            "query": query.urlencode(),
            "flagged_ids": set(
                RolloutFlag.objects.filter(rollout__in=page.object_list).values_list(
                    "rollout_id", flat=True
                )
            ),
            "flag_count": selectors.job_flag_count(job),
        },
    )


@login_required
def rollout_detail(request, pk: int, rollout_id: int):
    job = selectors.job_for_user(request.user, pk)
    rollout = selectors.rollout_for_job(job, rollout_id)
    siblings = (
        job.rollouts.filter(example_id=rollout.example_id)
        .exclude(pk=rollout.pk)
        .only("id", "step", "reward", "outcome")[:20]
    )
    env_class = selectors.job_env_class(job)
    return render(
        request,
        "jobs/rollout_detail.html",
        {
            "job": job,
            "rollout": rollout,
            "messages_shown": presenters.present_messages(rollout.messages, rollout.prompt_len),
            "facts": presenters.fact_rows(selectors.job_facts(job), rollout.facts),
            "views": presenters.state_views(env_class, rollout.state),
            "views_title": env_class.state_views_title if env_class else "",
            "siblings": siblings,
            "state_json": json.dumps(rollout.state, indent=2, sort_keys=True),
            "info_json": json.dumps(rollout.info, indent=2, sort_keys=True),
            "flag_form": FlagForm(),
            "my_flag": rollout.flags.filter(user=request.user).first(),
            "flag_count": rollout.flags.count(),
        },
    )


@login_required
def rollout_compare(request, pk: int):
    job = selectors.job_for_user(request.user, pk)
    ids = ids_from(request.GET.getlist("id"))[:2]
    if len(ids) != 2:
        messages.error(request, "Pick two rollouts to compare.")
        return redirect("jobs:rollout_list", pk=job.pk)
    pair = [selectors.rollout_for_job(job, i) for i in ids]
    if pair[0].example_id != pair[1].example_id:
        messages.warning(
            request,
            f"These rollouts played different examples ({pair[0].example_id} and "
            f"{pair[1].example_id}); side by side anyway.",
        )
    reward_names = selectors.rollout_reward_names(job, pair)
    env_class = selectors.job_env_class(job)
    columns = [
        {
            "rollout": r,
            "messages_shown": presenters.present_messages(r.messages, r.prompt_len),
            "views": presenters.state_views(env_class, r.state),
            "rewards": [(name, r.rewards.get(name)) for name in reward_names],
        }
        for r in pair
    ]
    return render(request, "jobs/rollout_compare.html", {"job": job, "columns": columns})


@login_required
def rollout_image(request, pk: int, rollout_id: int):
    """One image the rollout's env drew in its state views (the browser env's screenshots),
    read from the job's own folder: only a path the env listed, and only inside that
    folder (services.job_file_path); anything else is a 404."""
    job = selectors.job_for_user(request.user, pk)
    rollout = selectors.rollout_for_job(job, rollout_id)
    name = request.GET.get("path", "")
    listed = {
        image["path"]
        for view in presenters.state_views(selectors.job_env_class(job), rollout.state)
        for image in view.get("images", [])
    }
    content_type = services.IMAGE_TYPES.get(name.rsplit(".", 1)[-1].lower())
    if name not in listed or content_type is None:
        raise Http404("no such image in this rollout")
    try:
        path = services.job_file_path(job=job, name=name, what="image")
    except ValidationError:
        raise Http404("no such image in this rollout") from None
    return FileResponse(open(path, "rb"), content_type=content_type)


@login_required
def rollouts_jsonl(request, pk: int):
    job = selectors.job_for_user(request.user, pk)
    form, rows = _filtered_rollouts(request, job)
    if rows is None:
        return HttpResponse(
            json.dumps({"errors": form.errors.get_json_data()}),
            status=400,
            content_type="application/json",
        )
    lines = (jsonl_line(r.to_dict()) for r in rows.iterator())
    response = StreamingHttpResponse(lines, content_type="application/x-ndjson")
    response["Content-Disposition"] = f'attachment; filename="job-{job.pk}-rollouts.jsonl"'
    return response


# ---------------------------------------------------------------------------------------
# The verifier checklist: audits, flags, held-out deltas


@login_required
def env_config_audit(request, pk: int):
    """GET: the env config's last audit (progress while it runs, then the report); POST:
    run a new one."""
    config = get_object_or_404(selectors.env_configs_for_user(request.user), pk=pk)
    form = AuditForm(request.POST or None)
    if request.method == "POST":
        if form.is_valid():
            job = services.audit_create(owner=request.user, env_config=config, **form.cleaned_data)
            messages.success(request, f"Queued audit job #{job.pk}.")
            return redirect("jobs:env_config_audit", pk=config.pk)
        status = 400
    else:
        status = 200
    audit = selectors.last_audit(request.user, config)
    return render(
        request,
        "jobs/audit.html",
        {
            "config": config,
            "form": form,
            "audit": audit,
            "report": presenters.audit_report(audit.result if audit else None),
            "flag_count": selectors.flagged_rollouts(
                selectors.env_config_flags(request.user, config)
            ),
            "wait": _wait_for(audit),
        },
        status=status,
    )


def _wait_for(job: Job | None) -> dict | None:
    """What the page's script polls while `job` runs (it reloads the page at the end)."""
    if job is None or not job.is_active:
        return None
    return {"url": reverse("api:job_detail", args=[job.pk])}


@login_required
@require_GET
def job_report_json(request, pk: int):
    """An audit's or a held-out delta's report as a JSON download."""
    job = selectors.job_for_user(request.user, pk)
    key = {Job.Kind.AUDIT: "audit", Job.Kind.DELTA: "delta"}.get(job.kind)
    if key is None or not job.result or key not in job.result:
        raise Http404("only a finished audit or held-out delta has a report")
    response = HttpResponse(json.dumps(job.result[key], indent=2), content_type="application/json")
    response["Content-Disposition"] = f'attachment; filename="job-{job.pk}-{key}.json"'
    return response


@login_required
@require_POST
def rollout_flag(request, pk: int, rollout_id: int):
    """Flag the rollout as wrongly scored (with an optional reason), or with `remove`,
    take one's flag back."""
    job = selectors.job_for_user(request.user, pk)
    rollout = selectors.rollout_for_job(job, rollout_id)
    if request.POST.get("remove"):
        services.rollout_unflag(user=request.user, rollout=rollout)
        messages.success(request, "Flag removed.")
        return redirect(rollout)
    form = FlagForm(request.POST)
    if not form.is_valid():
        return HttpResponse(
            json.dumps({"errors": form.errors.get_json_data()}),
            status=400,
            content_type="application/json",
        )
    try:
        services.rollout_flag(
            user=request.user, rollout=rollout, reason=form.cleaned_data["reason"]
        )
    except ValidationError as exc:
        return HttpResponse(
            json.dumps({"errors": exc.message_dict}), status=400, content_type="application/json"
        )
    messages.success(request, "Flagged as wrongly scored.")
    return redirect(rollout)


FLAG_COLUMNS = ("job", "rollout", "env", "step", "example_id", "prompt", "reply", "reward",
                "outcome", "reason", "flagged_by", "flagged")  # fmt: skip


@login_required
@require_GET
def env_config_flags(request, pk: int, fmt: str):
    """The flagged rollouts of jobs on this env config, as CSV or JSON."""
    if fmt not in ("csv", "json"):
        raise Http404(f"flags come as .csv or .json, not .{fmt[:20]}")
    config = get_object_or_404(selectors.env_configs_for_user(request.user), pk=pk)
    rows = [flag.to_dict() for flag in selectors.env_config_flags(request.user, config)]
    filename = f"env-config-{config.pk}-flags.{fmt}"
    if fmt == "json":
        response = HttpResponse(json.dumps(rows, indent=2), content_type="application/json")
    else:
        response = HttpResponse(content_type="text/csv")
        writer = csv.writer(response)
        writer.writerow(FLAG_COLUMNS)
        writer.writerows([_csv_safe(row[column]) for column in FLAG_COLUMNS] for row in rows)
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response


def _csv_safe(value):
    """A cell a spreadsheet shows as text: model replies starting with = + - @ would
    otherwise run as formulas when the export is opened."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


@login_required
def delta_page(request):
    """Pick a trained model, its starting model and an env config; run the held-out delta.
    `?job=N` (a training job of yours) preselects its last checkpoint, its starting model
    and its env config."""
    initial = _delta_initial(request.user, ids_from([request.GET.get("job", "")]))
    form = DeltaForm(request.POST or None, user=request.user, initial=initial)
    status = 200
    if request.method == "POST":
        if form.is_valid():
            try:
                job = services.delta_create(owner=request.user, **form.cleaned_data)
            except (ValidationError, ParamError) as exc:
                form.add_service_error(
                    exc if isinstance(exc, ValidationError) else ValidationError(str(exc))
                )
            else:
                messages.success(request, f"Queued held-out delta job #{job.pk}.")
                return redirect("jobs:delta_detail", pk=job.pk)
        status = 400
    return render(
        request,
        "jobs/delta.html",
        {"form": form, "deltas": selectors.deltas_for_user(request.user)[:20]},
        status=status,
    )


def _delta_initial(user, job_ids: list[int]) -> dict:
    if not job_ids:
        return {}
    job = (
        selectors.jobs_for_user(user)
        .filter(owner=user, pk=job_ids[0], kind__in=(Job.Kind.SFT, Job.Kind.RL))
        .first()
    )
    if job is None:
        return {}
    last = job.current_checkpoints().filter(model_entry__isnull=False).order_by("step", "id").last()
    return {
        "trained": last.model_entry.pk if last else None,
        "base": job.model_id,
        "env_config": job.env_config_id,
    }


@login_required
def delta_detail(request, pk: int):
    job = selectors.job_for_user(request.user, pk)
    if job.kind != Job.Kind.DELTA:
        raise Http404("not a held-out delta")
    return render(
        request,
        "jobs/delta_detail.html",
        {
            "job": job,
            "delta": presenters.delta_report((job.result or {}).get("delta")),
            "wait": _wait_for(job),
        },
    )


# ---------------------------------------------------------------------------------------
# Nodes


@login_required
def node_list(request):
    """Every worker node: live, stopped or gone, its queues, GPUs and software, and the
    jobs it runs now (by number to whoever may see them, counted for the rest)."""
    visible = set(selectors.jobs_for_user(request.user).values_list("pk", flat=True))
    rows = [
        {
            "node": row["node"],
            "jobs": [job for job in row["jobs"] if job.pk in visible],
            "others": sum(job.pk not in visible for job in row["jobs"]),
        }
        for row in nodes_overview()
    ]
    return render(
        request,
        "jobs/node_list.html",
        {"rows": rows, "checkpoint_root": str(settings.CHECKPOINT_ROOT)},
    )
