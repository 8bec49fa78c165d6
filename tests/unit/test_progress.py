"""Start-up progress (`lightwell.progress`): a bar on a terminal, one INFO line with the seconds
per stage, nothing from ranks other than 0; the CUDA-graph capture stage run on CPU with a
capture function that records the keys (graphs themselves need a GPU)."""

from __future__ import annotations

import io
import logging
import re

import pytest

from lightwell import progress
from lightwell.worker.cuda_graph import capture_all

LOGGER = "lightwell.startup"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _rank0():
    progress.set_enabled(True)
    yield
    progress.set_enabled(True)


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_stage_draws_a_bar_on_a_terminal_and_logs_its_seconds(caplog):
    term = _Terminal()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        with progress.stage("Loading weights", total=3, unit="tensor", file=term) as st:
            seen = list(st.iter(["a", "b", "c"]))
            st.summary = "loaded 3 weight tensors"
    assert seen == ["a", "b", "c"]
    assert "Loading weights" in term.getvalue() and "3/3" in term.getvalue()
    (line,) = _lines(caplog)
    assert re.fullmatch(r"loaded 3 weight tensors in \d+\.\d s", line)
    assert st.seconds >= 0


def test_stage_without_total_is_one_line_and_no_bar_off_a_terminal(caplog):
    term, pipe = _Terminal(), io.StringIO()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        with progress.stage("Warming up", file=term):
            pass
        with progress.stage("Allocating the KV cache", file=pipe) as st:
            st.summary = "allocated the KV cache"
    assert term.getvalue().strip().startswith("Warming up ...")
    assert pipe.getvalue() == ""  # not a terminal: no bar, the INFO line only
    assert [line.split(" in ")[0] for line in _lines(caplog)] == [
        "Warming up",
        "allocated the KV cache",
    ]


def test_other_ranks_show_and_log_nothing(caplog):
    progress.set_enabled(False)
    term = _Terminal()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        with progress.stage("Loading weights", total=2, file=term) as st:
            assert st.bar is None  # no tqdm at all (its lock would outlive os._exit)
            list(st.iter([1, 2]))
    assert term.getvalue() == "" and _lines(caplog) == []


def test_a_failed_stage_closes_its_bar_without_a_summary(caplog):
    term = _Terminal()
    with caplog.at_level(logging.INFO, logger=LOGGER), pytest.raises(ValueError):
        with progress.stage("Loading weights", total=2, file=term) as st:
            for _ in st.iter([1, 2]):
                raise ValueError("bad tensor")
    assert _lines(caplog) == [] and st.bar.disable  # closed


def test_cuda_graph_capture_stage(caplog, monkeypatch):
    term = _Terminal()
    monkeypatch.setattr("sys.stderr", term)
    keys = [("mixed", 32), ("mixed", 16), ("decode", 4), ("decode", 2), ("decode", 1)]
    done = []
    with caplog.at_level(logging.INFO, logger=LOGGER):
        seconds = capture_all(keys, done.append)
    assert done == keys and seconds >= 0
    assert "Capturing CUDA graphs" in term.getvalue() and "5/5" in term.getvalue()
    (line,) = _lines(caplog)
    assert re.fullmatch(
        r"captured 5 CUDA graphs \(decode batch sizes \[1, 2, 4\]; steps with prefill up to "
        r"32 tokens\) in \d+\.\d s",
        line,
    )
