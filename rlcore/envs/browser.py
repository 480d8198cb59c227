"""The browser environment: do a task on a small shop website, in headless Chromium.

Each example is a task on the project's own site (browser_site.py), whose catalog is
drawn from the example's seed: order N of the cheapest product of a color and kind for a
named customer (`order`), send a given message through the contact form (`contact`), or
find a product's price and answer it (`price`). The model sees the page as a numbered
list of links, buttons, fields and text (browser_session.py) and replies with one action
per turn in an `<action>` tag:

    <action>click 4</action>            click element [4]
    <action>type 7 "red mug"</action>   replace the text of field [7]
    <action>back</action>               go back a page
    <action>answer "$12.50"</action>    answer, ending the episode
    <action>done</action>               end the episode

An action that cannot be read or carried out (no tag, an id not on the page, typing into
a button) is an invalid step: the model is told why and shown the same page, and the
step counts toward `max_turns`. The reward is a goal predicate, 1 or 0, on the
episode's own site database (one order of exactly that product and quantity, for that
name, email and shipping; one message with those fields) or on the answer (the price,
with or without "$"). Every rollout runs against a fresh site and a fresh browser
context, so what it does is a function of its seed and its replies. A JPEG of the page is
kept after every step carried out, under `output_dir` (the run's directory, which the
caller sets; else `$RLCORE_HOME/browser`), named in the final state and drawn by the
inspector.

Chromium is opened only for actions the page must carry out: the first page of each
example is read once, when the example is made, so a reply with no valid action costs no
browser work.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import random
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from functools import partial
from pathlib import Path
from typing import Any

from rlcore.envs.base import Fact, MultiTurnEnv, Param, example_seed
from rlcore.envs.browser_session import (
    OFF_SITE,
    ActionError,
    BrowserThread,
    Session,
    browser_thread,
)
from rlcore.envs.browser_site import COLORS, FEATURED, KINDS, SHIPPING, TOPICS, Site, catalog
from rlcore.envs.browser_site import site_server as _site_server
from rlcore.parsers import XMLParser, tag_contents
from rlcore.policy.base import ConstantPolicy, Policy
from rlcore.policy.tiny import rlcore_home
from rlcore.rubric import Rubric
from rlcore.types import Example, Generation, Message, Rollout

FAMILIES = ("order", "contact", "price")
MAX_ACTION_CHARS = 1_000
MAX_TYPED_CHARS = 300
SYSTEM_PROMPT = (
    "You use a web browser to do a task on a shop's website. Each page is shown as a list; "
    "links, buttons and fields have an id in brackets. Reply with one action in an "
    "<action> tag (you may think in <think>...</think> first):\n"
    "<action>click ID</action> clicks a link, button or option;\n"
    '<action>type ID "text"</action> replaces the text of a field (it does not submit);\n'
    "<action>back</action> goes back a page;\n"
    '<action>answer "text"</action> gives your answer and ends the task;\n'
    "<action>done</action> ends the task."
)
FIRST_NAMES = ("Ada", "Grace", "Alan", "Edsger", "Barbara", "Donald", "Frances", "Ken")
LAST_NAMES = ("Lovelace", "Hopper", "Turing", "Dijkstra", "Liskov", "Knuth", "Allen", "Thompson")
MESSAGES = (
    "Where is my order {n}?",
    "Please cancel order {n}.",
    "Can I return order {n}?",
    "Do you ship to Norway? Ref {n}",
)

# ---------------------------------------------------------------------------------------
# Actions


@dataclass(frozen=True)
class Action:
    verb: str  # click | type | back | answer | done
    element: int | None = None
    text: str = ""

    def __str__(self) -> str:
        if self.verb == "click":
            return f"click {self.element}"
        if self.verb == "type":
            return f'type {self.element} "{self.text}"'
        if self.verb == "answer":
            return f'answer "{self.text}"'
        return self.verb


_ID = r"\[?(\d{1,6})\]?"
_QUOTED = r"(?:\"(.*)\"|'(.*)')"
_PATTERNS = {
    "click": re.compile(rf"click\s+{_ID}", re.IGNORECASE),
    "type": re.compile(rf"type\s+{_ID}\s+{_QUOTED}", re.IGNORECASE | re.DOTALL),
    "back": re.compile(r"back", re.IGNORECASE),
    "done": re.compile(r"done", re.IGNORECASE),
    "answer": re.compile(rf"answer\s+(?:{_QUOTED}|(.*))", re.IGNORECASE | re.DOTALL),
}
USAGE = 'one of: click ID, type ID "text", back, answer "text", done'


def parse_action(text: str | None) -> tuple[Action | None, str | None]:
    """The action in a reply's last `<action>` tag, or (None, what was wrong). Never
    raises; ids have at most 6 digits and a tag at most MAX_ACTION_CHARS characters, so a
    reply of any size costs time linear in its length."""
    found = tag_contents(text, "action")
    if not found:
        return None, f"no <action>...</action> in the reply; write {USAGE}"
    body = found[-1].strip()
    if len(body) > MAX_ACTION_CHARS:
        return None, f"the action is {len(body)} characters long; at most {MAX_ACTION_CHARS}"
    for verb, pattern in _PATTERNS.items():
        match = pattern.fullmatch(body)
        if match is None:
            continue
        groups = match.groups()
        if verb == "click":
            return Action("click", int(groups[0])), None
        if verb == "type":
            typed = groups[1] if groups[1] is not None else groups[2]
            if len(typed) > MAX_TYPED_CHARS:
                return None, f"typed text is {len(typed)} characters; at most {MAX_TYPED_CHARS}"
            return Action("type", int(groups[0]), typed), None
        if verb == "answer":
            answer = next((g for g in groups if g is not None), "").strip()
            return Action("answer", text=answer[:MAX_TYPED_CHARS]), None
        return Action(verb), None
    shown = body if len(body) <= 60 else body[:60] + "..."
    return None, f"cannot read the action {shown!r}; write {USAGE}"


_PRICE_RE = re.compile(r"\$?\s*(\d{1,6}(?:\.\d{1,2})?)")


def parse_price(text: str | None) -> Decimal | None:
    """A price as the model may write it: `$12.50`, `12.50`, `12.5`, `$ 12.50`."""
    match = _PRICE_RE.fullmatch((text or "").strip().rstrip("."))
    if match is None:
        return None
    try:
        return Decimal(match.group(1))
    except InvalidOperation:
        return None


def _same_text(a: Any, b: Any) -> bool:
    """Equal up to case and runs of whitespace (how a person would read two entries)."""
    return " ".join(str(a).split()).casefold() == " ".join(str(b).split()).casefold()


# ---------------------------------------------------------------------------------------
# Tasks


def make_task(family: str, seed: int) -> dict:
    """The task of `family` for `seed`, as plain data: what the prompt says, and what the
    goal predicate checks."""
    rng = random.Random(seed)
    color, kind = rng.choice(COLORS), rng.choice(KINDS)
    products = catalog(seed, color, kind)
    first, last = rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES)
    name, email = f"{first} {last}", f"{first}.{last}@example.org".lower()
    task = {"family": family, "site_seed": seed, "color": color, "kind": kind}
    if family == "order":
        target = min((p for p in products if (p.color, p.kind) == (color, kind)),
                     key=lambda p: p.price_cents)  # fmt: skip
        quantity, shipping = rng.randint(2, 3), rng.choice(SHIPPING)
        task |= {"product_id": target.id, "product": target.name, "quantity": quantity,
                 "name": name, "email": email, "shipping": shipping}  # fmt: skip
        task["goal"] = (
            f"Order {quantity} of the cheapest {color} {kind} in the shop, with {shipping} "
            f"shipping, for {name} (email {email}). Say done when the order is placed."
        )
    elif family == "contact":
        topic = rng.choice(TOPICS)
        message = rng.choice(MESSAGES).format(n=rng.randint(100, 999))
        task |= {"name": name, "email": email, "topic": topic, "message": message}
        task["goal"] = (
            f'Send the shop a message through its contact form: name "{name}", email '
            f'"{email}", topic "{topic}", message "{message}". Say done when it is sent.'
        )
    else:
        target = rng.choice([p for p in products if p.id > FEATURED])
        task |= {"product_id": target.id, "product": target.name, "price": target.price}
        task["goal"] = (
            f'What does the "{target.name}" cost in the shop? Find it and answer with its '
            'price, e.g. answer "$1.23".'
        )
    return task


def site_for(task: dict) -> Site:
    return Site(catalog(task["site_seed"], task["color"], task["kind"]))


def goal_check(task: dict, site: Site, answer: str | None) -> tuple[bool, str]:
    """Whether the episode reached its goal, read from its site's database (order,
    contact) or its answer (price), and why or why not."""
    if task["family"] == "price":
        given = parse_price(answer)
        if given is None:
            return False, f"no price in the answer {answer!r}"[:200]
        expected = Decimal(task["price"].lstrip("$"))
        ok = given == expected
        return ok, f"answered {given}, the price is {expected}"
    if task["family"] == "order":
        orders = site.orders()
        if len(orders) != 1:
            return False, f"{len(orders)} orders placed; the task asks for exactly one"
        order, wanted = orders[0], {task["product_id"]: task["quantity"]}
        checks = {
            "items": order["lines"] == wanted,
            "name": _same_text(order["name"], task["name"]),
            "email": _same_text(order["email"], task["email"]),
            "shipping": order["shipping"] == task["shipping"],
        }
    else:
        messages = site.messages()
        if len(messages) != 1:
            return False, f"{len(messages)} messages sent; the task asks for exactly one"
        message = messages[0]
        checks = {
            "name": _same_text(message["name"], task["name"]),
            "email": _same_text(message["email"], task["email"]),
            "topic": message["topic"] == task["topic"],
            "message": _same_text(message["body"], task["message"]),
        }
    wrong = [name for name, ok in checks.items() if not ok]
    if wrong:
        return False, f"the {task['family']} is there but its {', '.join(wrong)} is wrong"
    return True, f"the {task['family']} matches the task"


# ---------------------------------------------------------------------------------------
# Episodes


@dataclass
class Episode:
    """What one rollout holds open: its site, its URL, and its browser once it acts."""

    site: Site
    url: str
    observation: str
    screenshot_dir: Path | None
    session: Session | None = None
    thread: BrowserThread | None = None
    shots: list[str] = field(default_factory=list)


def _first_page(browser, url: str) -> str:
    session = Session(browser, url, None)
    try:
        return session.observe()
    finally:
        session.close()


@functools.lru_cache(maxsize=512)
def first_observation(task_key: tuple, parallel: int) -> str:
    """The page a task starts on, read once per task in a browser."""
    task = dict(task_key)
    server = _site_server()
    url = server.open(site_for(task))
    try:
        return browser_thread(parallel).submit(_first_page, url).result()
    finally:
        server.close(url)


def _step(browser, episode: Episode, action: Action) -> tuple[str, str | None]:
    """Carry out `action` in the episode's browser (opened first if need be); returns the
    new page and the error, if the page could not do it. Runs on the browser's thread."""
    if episode.session is None:
        episode.session = Session(browser, episode.url, episode.screenshot_dir)
        episode.session.observe()
        _shoot(episode)
    session, error = episode.session, None
    try:
        if action.verb == "click":
            session.click(action.element)
        elif action.verb == "type":
            session.type(action.element, action.text)
        else:
            session.back()
    except ActionError as exc:
        error = str(exc)
    episode.observation = session.observe()
    if session.strayed:  # the action's navigation left the site after it returned
        session.strayed = False
        error = error or OFF_SITE
    if error is None:
        _shoot(episode)
    return episode.observation, error


def _shoot(episode: Episode) -> None:
    path = episode.session.screenshot(f"step-{len(episode.shots):02d}.jpg")
    if path is not None:
        episode.shots.append(path)


def _close(browser, episode: Episode) -> None:
    if episode.session is not None:
        episode.session.close()
        episode.session = None


# ---------------------------------------------------------------------------------------
# Rewards


def format_reward(*, completion: list[Message], **_) -> float:
    """The share of the model's replies holding an action that can be read."""
    replies = [m.get("content") or "" for m in completion if m.get("role") == "assistant"]
    if not replies:
        return 0.0
    return sum(parse_action(text)[0] is not None for text in replies) / len(replies)


def goal_reward(*, state: dict, **_) -> float:
    """1 when the episode reached its goal (see `goal_check`), else 0."""
    return 1.0 if (state.get("goal") or {}).get("reached") else 0.0


_episode_key: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "browser_episode", default=None
)


class BrowserEnv(MultiTurnEnv):
    """Tasks on a small shop website done in headless Chromium; a goal predicate scores."""

    name = "browser"
    description = (
        "Do a task on a small shop website (order, contact form, find a price) in headless "
        "Chromium by clicking and typing on a numbered page; the reward is whether the "
        "site's database (or the answer) reaches the goal. Screenshots of every step."
    )
    outcome_labels = ("success", "failure")
    facts = [
        Fact("family", "task family", "str", "order, contact or price."),
        Fact("steps", "steps", "int", "Actions the model took, invalid ones included."),
        Fact(
            "invalid_actions", "invalid actions", "int", "Actions that could not be read or done."
        ),
        Fact("goal_reached", "goal reached", "int", "1 when the goal predicate held.", 0, 1),
    ]
    state_views_title = "Browser"
    params = [
        Param(
            "task_family",
            str,
            "all",
            "Which tasks: 'all' mixes order, contact and price tasks evenly.",
            choices=("all", *FAMILIES),
        ),
        Param(
            "max_turns",
            int,
            20,
            "Most model replies per episode, invalid ones included; then it ends as it is.",
            min=1,
            max=60,
        ),
        Param(
            "parallel_browsers",
            int,
            2,
            "Chromium processes a worker runs episodes in (each episode has its own context).",
            min=1,
            max=16,
        ),
        Param(
            "screenshots",
            bool,
            True,
            "Keep a JPEG of the page after every step, shown in the rollout inspector.",
        ),
    ]

    def __init__(self, **params):
        super().__init__(**params)
        # Screenshots go under `output_dir` (the run's directory, which eval and RL set);
        # None keeps them under $RLCORE_HOME/browser.
        self._episodes: dict[str, Episode] = {}

    def build_parser(self) -> XMLParser:
        return XMLParser(["action"])

    def build_rubric(self) -> Rubric:
        rubric = Rubric()
        rubric.add(goal_reward, 1.0, name="goal", bounds=(0.0, 1.0))
        rubric.add(format_reward, 0.0, name="format", bounds=(0.0, 1.0))
        return rubric

    @property
    def families(self) -> tuple[str, ...]:
        family = self.config["task_family"]
        return FAMILIES if family == "all" else (family,)

    @property
    def num_groups(self) -> int:
        return len(self.families)

    def make_example(self, index: int, seed: int) -> Example:
        ex_seed = example_seed(seed, index)
        group = index % self.num_groups
        task = make_task(self.families[group], ex_seed)
        page = first_observation(tuple(sorted(task.items())), self.config["parallel_browsers"])
        return Example(
            id=index,
            seed=ex_seed,
            group=group,
            prompt=[
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"Task: {task['goal']}\n\n{page}"},
            ],
            info={"task": task, "first_page": page},
        )

    # -- the episode ------------------------------------------------------------------------
    def _screenshot_root(self) -> Path:
        return Path(self.output_dir) if self.output_dir else rlcore_home() / "browser"

    async def rollout(self, policy, example, sampling) -> Rollout:
        key = uuid.uuid4().hex
        token = _episode_key.set(key)
        try:
            return await super().rollout(policy, example, sampling)
        finally:
            _episode_key.reset(token)
            await self._end_episode(key)

    def setup_state(self, example: Example) -> dict:
        key = _episode_key.get() or uuid.uuid4().hex
        task = example.info["task"]
        shots = None
        if self.config["screenshots"]:
            shots = self._screenshot_root() / "screenshots" / f"example-{example.id}-{key[:12]}"
        site = site_for(task)
        self._episodes[key] = Episode(
            site=site,
            url=_site_server().open(site),
            observation=example.info["first_page"],
            screenshot_dir=shots,
        )
        return {
            "episode": key,
            "task": task,
            "family": task["family"],
            "steps": 0,
            "invalid_actions": 0,
            "actions": [],
            "answer": None,
            "finished": None,
            "screenshot_root": str(self._screenshot_root()),
            "screenshots": [],
        }

    def _record(self, state: dict, action: str, error: str | None) -> None:
        state["steps"] += 1
        if error is not None:
            state["invalid_actions"] += 1
        state["actions"].append({"step": state["steps"], "action": action[:200], "error": error})

    def is_completed(self, messages: list[Message], state: dict) -> bool:
        if state.get("finished"):
            return True
        last = messages[-1] if messages else {}
        if last.get("role") != "assistant":
            return False
        action, _ = parse_action(last.get("content"))
        if action is None or action.verb not in ("answer", "done"):
            return False
        self._record(state, str(action), None)
        state["finished"] = action.verb
        state["answer"] = action.text if action.verb == "answer" else None
        return True

    async def env_response(self, messages: list[Message], state: dict) -> list[Message]:
        episode = self._episodes[state["episode"]]
        action, error = parse_action(messages[-1].get("content"))
        if action is None:
            self._record(state, "(unreadable)", error)
            return [_page_message(episode.observation, error)]
        if episode.thread is None:
            episode.thread = browser_thread(self.config["parallel_browsers"])
        future = episode.thread.submit(_step, episode, action)
        page, error = await asyncio.wrap_future(future)
        self._record(state, str(action), error)
        root = self._screenshot_root()
        state["screenshots"] = [
            {"path": str(Path(path).relative_to(root)), "caption": _caption(i, state)}
            for i, path in enumerate(episode.shots)
        ]
        return [_page_message(page, error)]

    async def verify(self, rollout: Rollout, example: Example) -> None:
        state = rollout.state
        episode = self._episodes.get(state.get("episode", ""))
        if episode is None:
            return
        reached, reason = goal_check(state["task"], episode.site, state.get("answer"))
        state["goal"] = {"reached": reached, "reason": reason}
        if episode.session is not None:
            state["blocked_requests"] = list(episode.session.blocked[:20])

    async def _end_episode(self, key: str) -> None:
        episode = self._episodes.pop(key, None)
        if episode is None:
            return
        if episode.thread is not None:
            await asyncio.wrap_future(episode.thread.submit(_close, episode))
        _site_server().close(episode.url)

    # -- summaries and the inspector --------------------------------------------------------
    def outcome(self, state: dict, rewards: dict[str, float]) -> str:
        return "success" if rewards.get("goal") == 1.0 else "failure"

    def rollout_metrics(self, rollout: Rollout) -> dict[str, float]:
        steps = rollout.state.get("steps", 0)
        invalid = rollout.state.get("invalid_actions", 0)
        return {
            "steps": float(steps),
            "invalid_action_rate": invalid / steps if steps else 0.0,
        }

    def breakdowns(self, rollout: Rollout) -> dict[str, str]:
        family = rollout.state.get("family") or (rollout.info.get("task") or {}).get("family")
        return {"family": family} if isinstance(family, str) else {}

    def rollout_values(self, rollout: Rollout) -> dict[str, Any]:
        goal = rollout.state.get("goal")
        return {
            "family": rollout.state.get("family"),
            "steps": rollout.state.get("steps"),
            "invalid_actions": rollout.state.get("invalid_actions"),
            "goal_reached": int(bool(goal.get("reached"))) if isinstance(goal, dict) else None,
        }

    @classmethod
    def state_views(cls, state: dict) -> list[dict]:
        """The goal's verdict and the steps as text, then the screenshots (paths relative
        to the run's directory, which the page serves them from)."""
        if not isinstance(state, dict) or not isinstance(state.get("actions"), list):
            return []
        lines = []
        goal = state.get("goal")
        if isinstance(goal, dict):
            lines.append(f"goal {'reached' if goal.get('reached') else 'not reached'}: "
                         f"{goal.get('reason', '')}")  # fmt: skip
        for entry in state["actions"]:
            if isinstance(entry, dict):
                error = entry.get("error")
                suffix = f"  -> invalid: {error}" if error else ""
                lines.append(f"{entry.get('step')}. {entry.get('action')}{suffix}")
        views = [{"kind": "text", "title": "Goal and steps", "text": "\n".join(lines)}]
        shots = state.get("screenshots")
        if isinstance(shots, list) and shots:
            images = [
                {"path": str(s.get("path", "")), "caption": str(s.get("caption", ""))}
                for s in shots
                if isinstance(s, dict)
            ]
            views.append({"kind": "images", "title": "Screenshots", "images": images})
        return views

    # -- players -------------------------------------------------------------------------
    @property
    def verify_parallelism(self) -> int:
        return self.config["parallel_browsers"]

    def builtin_policies(self) -> dict[str, Callable[[], Policy]]:
        return {
            "constant": partial(ConstantPolicy, "<action>done</action>"),
            "oracle": BrowserOraclePolicy,
            "random": BrowserRandomPolicy,
        }

    def known_exploits(self) -> dict[str, Callable[[], Policy]]:
        return {
            "answer a made-up price": partial(ConstantPolicy, '<action>answer "$49.99"</action>'),
            "answer many prices at once": partial(
                ConstantPolicy,
                '<action>answer "'
                + " ".join(f"${n}.{c:02d}" for n in range(3, 99) for c in (0, 50))
                + '"</action>',
            ),
            "click the first link forever": partial(ConstantPolicy, "<action>click 1</action>"),
        }

    def format_variants(self) -> dict[str, Callable[[str], str]]:
        return {
            "upper-case verbs": lambda text: re.sub(
                r"<action>\s*(\w+)", lambda m: f"<action>{m.group(1).upper()}", text
            ),
            "ids in brackets": lambda text: re.sub(
                r"<action>(\w+) (\d+)", r"<action>\1 [\2]", text
            ),
            "single quotes": lambda text: text.replace('"', "'"),
            "spaces inside the tag": lambda text: text.replace("<action>", "<action> ").replace(
                "</action>", " </action>"
            ),
            "price without $": lambda text: text.replace('answer "$', 'answer "'),
        }


def _page_message(page: str, error: str | None) -> Message:
    if error is None:
        return {"role": "user", "content": page}
    return {"role": "user", "content": f"Invalid action: {error}. The page is as before:\n\n{page}"}


def _caption(index: int, state: dict) -> str:
    if index == 0:
        return "start"
    done = [entry for entry in state["actions"] if entry.get("error") is None]
    return f"{done[index - 1]['step']}. {done[index - 1]['action']}" if index <= len(done) else ""


# ---------------------------------------------------------------------------------------
# Built-in players

_ELEMENT_RE = re.compile(r'^\[(\d+)\] (\w+) "(.*?)"(?: value="(.*)")?( \(checked\))?$')


@dataclass
class PageElement:
    id: int
    role: str
    name: str
    value: str | None
    checked: bool


def read_page(text: str) -> tuple[str, list[PageElement], list[str]]:
    """(title, elements, all lines) of a page as `format_observation` wrote it."""
    lines = text.splitlines()
    title = next((line[6:] for line in lines if line.startswith("Page: ")), "")
    elements = []
    for line in lines:
        match = _ELEMENT_RE.match(line)
        if match:
            elements.append(
                PageElement(int(match[1]), match[2], match[3], match[4], bool(match[5]))
            )
    return title, elements, lines


def _last_page(messages: list[Message]) -> str:
    for message in reversed(messages):
        if message.get("role") == "user":
            return message.get("content") or ""
    return ""


def _act(action: str) -> Generation:
    return Generation(text=f"<action>{action}</action>")


class BrowserOraclePolicy(Policy):
    """Does each task the way a careful person would, reading only the page it is shown
    (and the task): search, pick, fill in, submit, then `done` or the answer."""

    name = "oracle"

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        task = (state or {}).get("task") or {}
        title, elements, lines = read_page(_last_page(messages))
        by_name = {}
        for element in elements:
            by_name.setdefault((element.role, element.name), element)
        family = task.get("family")
        if family == "contact":
            return self._contact(task, title, elements, by_name)
        wanted = (
            task.get("product") if family == "price" else f"{task.get('color')} {task.get('kind')}"
        )
        if title.startswith("Results for") or title.startswith("All products"):
            if family == "price":
                for index, line in enumerate(lines):
                    if line.endswith(f'link "{task["product"]}"') and index + 1 < len(lines):
                        return _act(f'answer "{lines[index + 1].strip()}"')
            else:
                target = by_name.get(("link", task["product"]))
                if target is not None:
                    return _act(f"click {target.id}")
        if family == "order":
            step = self._order(task, title, by_name)
            if step is not None:
                return step
        search = next(
            (e for e in elements if e.role == "textbox" and e.name == "Search products"), None
        )
        if search is not None and search.value != wanted:
            return _act(f'type {search.id} "{wanted}"')
        button = by_name.get(("button", "Search"))
        return _act(f"click {button.id}" if button else "back")

    def _order(self, task: dict, title: str, by_name: dict) -> Generation | None:
        if title.startswith("Order "):
            return _act("done")
        if title.startswith(task["product"]):
            quantity = by_name.get(("spinbutton", "Quantity"))
            if quantity is not None and quantity.value != str(task["quantity"]):
                return _act(f'type {quantity.id} "{task["quantity"]}"')
            return _act(f"click {by_name[('button', 'Add to cart')].id}")
        if title.startswith("Your cart") and ("link", "Checkout") in by_name:
            return _act(f"click {by_name[('link', 'Checkout')].id}")
        if title.startswith("Checkout"):
            return _fill(
                by_name,
                [("Full name", task["name"]), ("Email", task["email"])],
                f"{task['shipping'].capitalize()} shipping",
                "Place order",
            )
        return None

    def _contact(self, task: dict, title: str, elements, by_name: dict) -> Generation:
        if title.startswith("Message sent"):
            return _act("done")
        if not title.startswith("Contact us"):
            return _act(f"click {by_name[('link', 'Contact')].id}")
        return _fill(
            by_name,
            [
                ("Your name", task["name"]),
                ("Your email", task["email"]),
                ("Message", task["message"]),
            ],  # fmt: skip
            task["topic"],
            "Send message",
        )


def _fill(by_name: dict, fields: list[tuple[str, str]], option: str, submit: str) -> Generation:
    """The next step of filling in a form: a field that does not hold its text yet, the
    option if it is not checked, else the submit button."""
    for label, text in fields:
        element = by_name.get(("textbox", label))
        if element is not None and element.value != text:
            return _act(f'type {element.id} "{text}"')
    radio = by_name.get(("radio", option))
    if radio is not None and not radio.checked:
        return _act(f"click {radio.id}")
    return _act(f"click {by_name[('button', submit)].id}")


class BrowserRandomPolicy(Policy):
    """Clicks a random element of the page, or types a random word into a random field,
    and sometimes goes back or stops: a baseline that does things, none of them meant."""

    name = "random"

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        _, elements, _ = read_page(_last_page(messages))
        roll = self.rng.random()
        if not elements or roll < 0.05:
            return _act("done")
        if roll < 0.15:
            return _act("back")
        element = self.rng.choice(elements)
        if element.role in ("textbox", "spinbutton") and self.rng.random() < 0.7:
            word = self.rng.choice(["mug", "2", "Ada", "red", "hello@example.org"])
            return _act(f'type {element.id} "{word}"')
        return _act(f"click {element.id}")
