"""JSON endpoints: jobs (list, detail, create, cancel), metrics after a step cursor,
rollouts (filtered, paged), log lines after an id, and the catch-up bundle a live page
fetches on (re)connect; the verifier checklist: an env config's audit, flags on rollouts
(add, remove, list per env config), the held-out delta.

Session authentication (the pages' login); POSTs need the CSRF token header like any
form. Errors are JSON: 401 without a login, 404 for a job that is not yours or does not
exist, 400 with {"errors": {field: [messages]}} naming each bad field.
"""

from __future__ import annotations

import functools
import json

from django.core.exceptions import ValidationError
from django.core.paginator import EmptyPage, Paginator
from django.http import Http404, HttpResponse, JsonResponse
from django.utils.cache import get_conditional_response
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from rlcore.envs import ParamError
from webapp.jobs import selectors, services
from webapp.jobs.forms import AuditForm, DeltaForm, FlagForm, RolloutFilterForm
from webapp.jobs.models import Job
from webapp.jobs.services import CONFIG_CLASSES
from webapp.jobs.validation import errors_response, json_body, validation_response

MAX_PAGE_SIZE = 500


def api_view(view):
    """Login required (401 JSON, no redirect) and 404s as JSON."""

    @functools.wraps(view)
    def wrapper(request, *args, **kwargs):
        if not request.user.is_authenticated:
            return JsonResponse({"error": "authentication required; log in first"}, status=401)
        try:
            return view(request, *args, **kwargs)
        except Http404:
            return JsonResponse({"error": "not found"}, status=404)

    return wrapper


def _int_param(request, name: str, *, default=None, minimum=None, maximum=None):
    """An integer query parameter, or ValidationError naming it."""
    raw = request.GET.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValidationError({name: f"expected an integer, got {raw!r}"}) from None
    if minimum is not None and value < minimum:
        raise ValidationError({name: f"must be at least {minimum}, got {value}"})
    if maximum is not None and value > maximum:
        raise ValidationError({name: f"must be at most {maximum}, got {value}"})
    return value


@require_http_methods(["GET", "POST"])
@api_view
def jobs(request):
    if request.method == "POST":
        return _job_create(request)
    rows = selectors.jobs_for_user(request.user)
    status = request.GET.get("status")
    if status:
        if status not in Job.Status.values:
            return errors_response(
                {"status": f"unknown status {status!r}; accepted: {', '.join(Job.Status.values)}"}
            )
        rows = rows.filter(status=status)
    kind = request.GET.get("kind")
    if kind:
        if kind not in Job.Kind.values:
            return errors_response(
                {"kind": f"unknown kind {kind!r}; accepted: {', '.join(Job.Kind.values)}"}
            )
        rows = rows.filter(kind=kind)
    try:
        limit = _int_param(request, "limit", default=100, minimum=1, maximum=1000)
    except ValidationError as exc:
        return validation_response(exc)
    return JsonResponse({"jobs": [job.to_dict() for job in rows[:limit]]})


def _own(request, selector, raw_id):
    """The user's own row with id `raw_id` (an int or digits), else None."""
    if isinstance(raw_id, bool) or not (isinstance(raw_id, int) or str(raw_id).isdigit()):
        return None
    return selector(request.user).filter(owner=request.user, pk=int(raw_id)).first()


def _job_create(request) -> JsonResponse:
    try:
        body = json_body(request)
    except ValidationError as exc:
        return validation_response(exc)
    errors = {}
    kind = body.get("kind")
    if kind not in CONFIG_CLASSES:
        errors["kind"] = f"expected one of {', '.join(CONFIG_CLASSES)}, got {kind!r}"
    model = _own(request, selectors.models_for_user, body.get("model"))
    if model is None:
        errors["model"] = f"no model with id {body.get('model')!r} among yours"
    env_config = None
    if body.get("env_config") is not None:
        env_config = _own(request, selectors.env_configs_for_user, body["env_config"])
        if env_config is None:
            errors["env_config"] = (
                f"no environment config with id {body['env_config']!r} among yours"
            )
    options = body.get("options", {})
    if not isinstance(options, dict):
        errors["options"] = 'expected an object of config settings, e.g. {"num_examples": 20}'
    overrides = body.get("overrides", "")
    if not isinstance(overrides, str):
        errors["overrides"] = "expected key=value lines as one string"
    if errors:
        return errors_response(errors)
    try:
        job = services.job_create(
            owner=request.user,
            kind=kind,
            env_config=env_config,
            model=model,
            options=options,
            overrides=overrides,
            recipe=body.get("recipe"),  # checked by the services, like the rest
        )
    except ValidationError as exc:
        return validation_response(exc)
    except ParamError as exc:
        return errors_response({"env_config": str(exc)})
    warning = services.judge_family_warning(env_config=job.env_config, model=job.model)
    return JsonResponse({**job.to_dict(), "warnings": [warning] if warning else []}, status=201)


@require_GET
@api_view
def job_detail(request, pk: int):
    job = services.job_check_worker(job=selectors.job_for_user(request.user, pk))
    return JsonResponse(job.to_dict())


@require_POST
@api_view
def job_cancel(request, pk: int):
    job = selectors.job_for_user(request.user, pk)
    try:
        job = services.job_cancel(job=job)
    except ValidationError as exc:
        return errors_response({"status": exc.messages})
    return JsonResponse(job.to_dict())


@require_GET
@api_view
def job_metrics(request, pk: int):
    """?since=N: points with step > N; ?names=a,b: only those series; ?max_points=M:
    longer series are downsampled keeping each bin's min and max.

    The ETag names the version of the job's series (see selectors.metric_series_version);
    a request whose If-None-Match holds it gets 304 with no body. Ownership is checked
    first, so a 304 tells nobody about a job that is not theirs."""
    job = selectors.job_version_for_user(request.user, pk)
    try:
        since = _int_param(request, "since")
        max_points = _int_param(
            request, "max_points", default=selectors.DEFAULT_MAX_POINTS, minimum=2, maximum=100000
        )
    except ValidationError as exc:
        return validation_response(exc)
    names = [n for n in request.GET.get("names", "").split(",") if n]
    version = selectors.metric_series_version(job, since=since, names=names, max_points=max_points)
    etag = f'"{version}"'
    response = get_conditional_response(request, etag=etag)
    if response is None:
        series = selectors.metric_series_json(
            job, since=since, names=names, max_points=max_points, version=version
        )
        head = json.dumps({"job": job.pk, "since": since, "last_step": job.last_step})
        # The cached series is spliced in as it was encoded.
        body = head.removesuffix("}").encode() + b', "metrics": ' + series + b"}"
        response = HttpResponse(body, content_type="application/json")
    response["ETag"] = etag
    # Per user, and to be revalidated: a running job's series changes every step.
    response["Cache-Control"] = "private, no-cache"
    return response


@require_GET
@api_view
def job_rollouts(request, pk: int):
    job = selectors.job_for_user(request.user, pk)
    form = RolloutFilterForm(request.GET, facts=selectors.job_facts(job))
    if not form.is_valid():
        return errors_response(
            {k: [e["message"] for e in v] for k, v in form.errors.get_json_data().items()}
        )
    try:
        page_number = _int_param(request, "page", default=1, minimum=1)
        page_size = _int_param(request, "page_size", default=50, minimum=1, maximum=MAX_PAGE_SIZE)
    except ValidationError as exc:
        return validation_response(exc)
    paginator = Paginator(selectors.rollouts_filtered(job, form.filters()), page_size)
    try:
        page = paginator.page(page_number)
    except EmptyPage:
        return errors_response(
            {"page": f"page {page_number} is past the last page ({paginator.num_pages})"}
        )
    full = request.GET.get("full") in ("1", "true")
    return JsonResponse(
        {
            "job": job.pk,
            "count": paginator.count,
            "page": page.number,
            "num_pages": paginator.num_pages,
            "results": [r.to_dict() if full else r.to_summary() for r in page.object_list],
        }
    )


@require_GET
@api_view
def rollout_detail(request, pk: int, rollout_id: int):
    job = selectors.job_for_user(request.user, pk)
    return JsonResponse(selectors.rollout_for_job(job, rollout_id).to_dict())


@require_GET
@api_view
def job_logs(request, pk: int):
    job = selectors.job_for_user(request.user, pk)
    try:
        after = _int_param(request, "after")
    except ValidationError as exc:
        return validation_response(exc)
    return JsonResponse(
        {"job": job.pk, "logs": [line.to_dict() for line in selectors.logs_after(job, after=after)]}
    )


@require_GET
@api_view
def job_updates(request, pk: int):
    """Everything a live page may have missed: job state, metrics with step > since,
    the newest rollouts after since, log lines after log_after, checkpoints."""
    job = services.job_check_worker(job=selectors.job_for_user(request.user, pk))
    try:
        since = _int_param(request, "since")
        log_after = _int_param(request, "log_after")
    except ValidationError as exc:
        return validation_response(exc)
    return JsonResponse(
        {
            "job": services.job_status_payload(job),
            "metrics": selectors.metric_series(job, since=since),
            "rollouts": [r.to_summary() for r in selectors.recent_rollouts(job, since=since)],
            "logs": [line.to_dict() for line in selectors.logs_after(job, after=log_after)],
            "checkpoints": [
                {"id": c.pk, "step": c.step, "path": c.path} for c in job.current_checkpoints()
            ],
        }
    )


# ---------------------------------------------------------------------------------------
# The verifier checklist


def _form_errors(form) -> JsonResponse:
    return errors_response(
        {k: [e["message"] for e in v] for k, v in form.errors.get_json_data().items()}
    )


@require_POST
@api_view
def env_config_audit(request, pk: int):
    """Run the verifier audit of one of your env configs: {num_examples, seed,
    rollouts_per_step, step_seconds} (all optional); 201 with the job, whose `result`
    holds the report once it succeeded."""
    config = selectors.env_configs_for_user(request.user).filter(pk=pk).first()
    if config is None:
        raise Http404
    try:
        body = json_body(request)
    except ValidationError as exc:
        return validation_response(exc)
    form = AuditForm({name: field.initial for name, field in AuditForm.base_fields.items()} | body)
    if not form.is_valid():
        return _form_errors(form)
    job = services.audit_create(owner=request.user, env_config=config, **form.cleaned_data)
    return JsonResponse(job.to_dict(), status=201)


@require_GET
@api_view
def env_config_flags(request, pk: int):
    """The flagged rollouts of jobs on one of your env configs."""
    config = selectors.env_configs_for_user(request.user).filter(pk=pk).first()
    if config is None:
        raise Http404
    flags = selectors.env_config_flags(request.user, config)
    return JsonResponse({"env_config": config.pk, "flags": [flag.to_dict() for flag in flags]})


@require_POST
@api_view
def delta_create(request):
    """Run the held-out delta: {env_config, base, trained (model ids), num_examples,
    rollouts_per_example, seed, max_tokens, temperature}; 201 with the job."""
    try:
        body = json_body(request)
    except ValidationError as exc:
        return validation_response(exc)
    defaults = {name: field.initial for name, field in DeltaForm.base_fields.items()}
    form = DeltaForm({k: v for k, v in defaults.items() if v is not None} | body, user=request.user)
    if not form.is_valid():
        return _form_errors(form)
    try:
        job = services.delta_create(owner=request.user, **form.cleaned_data)
    except ValidationError as exc:
        return validation_response(exc)
    except ParamError as exc:
        return errors_response({"env_config": str(exc)})
    return JsonResponse(job.to_dict(), status=201)


@require_http_methods(["POST", "DELETE"])
@api_view
def rollout_flag(request, pk: int, rollout_id: int):
    """POST {reason}: flag the rollout as wrongly scored (201; again: the reason is
    replaced); DELETE: take your flag back (204, or 404 without one)."""
    job = selectors.job_for_user(request.user, pk)
    rollout = selectors.rollout_for_job(job, rollout_id)
    if request.method == "DELETE":
        if not services.rollout_unflag(user=request.user, rollout=rollout):
            return JsonResponse({"error": "you have not flagged this rollout"}, status=404)
        return HttpResponse(status=204)
    try:
        body = json_body(request)
    except ValidationError as exc:
        return validation_response(exc)
    if not isinstance(body.get("reason", ""), str):
        return errors_response({"reason": "expected text (at most 200 characters)"})
    form = FlagForm(body)
    if not form.is_valid():
        return _form_errors(form)
    try:
        flag = services.rollout_flag(
            user=request.user, rollout=rollout, reason=form.cleaned_data["reason"]
        )
    except ValidationError as exc:
        return validation_response(exc)
    return JsonResponse(
        {"rollout": rollout.pk, "reason": flag.reason, "flags": rollout.flags.count()}, status=201
    )
