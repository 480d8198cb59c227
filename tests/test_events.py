"""The console sink: the progress bar (rate, ETA), log lines and metric lines."""

import io

from rlcore.events import ConsoleSink


def test_the_bar_shows_rate_and_eta_and_survives_a_re_estimated_total():
    stream = io.StringIO()
    sink = ConsoleSink(stream=stream, metric_keys=["loss"])
    sink.progress(1, 100, "rl")
    bar = sink._bar
    sink.progress(2, 40, "rl")  # the same work, its total re-estimated
    assert sink._bar is bar and bar.total == 40 and bar.n == 2
    sink.metric(2, {"loss": 0.5, "other": 1.0})
    sink.progress(40, 40, "rl")
    assert sink._bar is None  # done: closed
    text = stream.getvalue()
    assert "rl: 100%" in text and "40/40" in text
    assert "it/s" in text or "s/it" in text  # the rate
    assert "<00:00" in text  # elapsed<remaining: the ETA
    assert "step 2: loss=0.5" in text and "other" not in text


def test_a_new_kind_of_work_starts_a_new_bar():
    stream = io.StringIO()
    sink = ConsoleSink(stream=stream)
    sink.progress(1, 10, "sft")
    first = sink._bar
    sink.progress(1, 10, "eval")
    assert sink._bar is not first and sink._bar.desc.startswith("eval")
