"""`bench serve` metrics on hand-made timings, arrival times, datasets and result records."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from lightwell.bench import datasets, report
from lightwell.bench.metrics import (
    RequestResult,
    compute_metrics,
    count_good,
    max_in_flight,
    parse_goodput,
)
from lightwell.bench.serve import RunResult, arrival_offsets, parse_rates


def _results() -> list[RequestResult]:
    return [
        RequestResult(10, True, 4, "", ttft=0.1, itl=[0.02, 0.03, 0.05], latency=0.2),
        RequestResult(20, True, 2, "", ttft=0.2, itl=[0.1], latency=0.3, start_time=0.1),
        RequestResult(30, True, 1, "", ttft=0.4, itl=[], latency=0.4, start_time=0.15),
        RequestResult(40, False, None, "", latency=0.05, start_time=1.0, error="HTTP 500"),
    ]


def test_counts_and_throughputs():
    m = compute_metrics(_results(), 2.0)
    assert (m.completed, m.failed) == (3, 1)
    assert m.total_input == 60  # failed requests' prompts are not counted
    assert m.total_output == 7
    assert m.output_lens == [4, 2, 1, 0]
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(3.5)
    assert m.total_token_throughput == pytest.approx(33.5)
    assert m.request_goodput is None


def test_ttft_distribution_exact():
    d = compute_metrics(_results(), 2.0, percentiles=[50, 95, 99]).ttft  # [100, 200, 400] ms
    assert d.mean == pytest.approx(700 / 3)
    assert d.median == pytest.approx(200)
    assert d.std == pytest.approx(
        np.sqrt(((100 - 700 / 3) ** 2 + (200 - 700 / 3) ** 2 + (400 - 700 / 3) ** 2) / 3)
    )
    assert d.percentiles[50.0] == pytest.approx(200)
    assert d.percentiles[95.0] == pytest.approx(380)  # linear: 200 + 0.9 * 200
    assert d.percentiles[99.0] == pytest.approx(396)


def test_tpot_excludes_single_token_requests():
    d = compute_metrics(_results(), 2.0).tpot  # (0.2 - 0.1) / 3 and (0.3 - 0.2) / 1
    assert d.mean == pytest.approx((100 / 3 + 100) / 2)
    assert d.median == pytest.approx((100 / 3 + 100) / 2)
    assert d.percentiles[99.0] == pytest.approx(100 / 3 + 0.99 * (100 - 100 / 3))


def test_itl_pools_every_gap_and_e2e():
    m = compute_metrics(_results(), 2.0)
    assert sorted(m.raw["itl"]) == pytest.approx([0.02, 0.03, 0.05, 0.1])
    assert m.itl.mean == pytest.approx(50)
    assert m.itl.median == pytest.approx(40)
    assert m.itl.percentiles[95.0] == pytest.approx(92.5)  # 50 + 0.85 * 50
    assert m.e2el.mean == pytest.approx(300)
    assert m.e2el.percentiles[99.0] == pytest.approx(398)


def test_output_tokens_counted_by_tokenizer_without_usage():
    r = RequestResult(5, True, None, "a b c d e", ttft=0.1, itl=[0.1] * 4, latency=0.5)
    m = compute_metrics([r], 1.0, count_tokens=lambda t: len(t.split()))
    assert m.total_output == 5
    assert m.tpot.mean == pytest.approx(100)
    with pytest.raises(ValueError, match="no tokenizer"):
        compute_metrics([r], 1.0)


def test_all_failed_reports_zeros():
    m = compute_metrics([RequestResult(5, False, error="x")], 1.0)
    assert (m.completed, m.failed, m.total_output) == (0, 1, 0)
    assert m.ttft.mean == 0.0 and m.ttft.percentiles[99.0] == 0.0
    with pytest.raises(ValueError):
        compute_metrics([], 0.0)


@pytest.mark.parametrize(
    "spec, good",
    [
        ("ttft:250", 2),
        ("ttft:200", 2),  # equal to the limit counts as met
        ("ttft:250,tpot:50", 1),  # the 1-token request has TPOT 0 but TTFT 400
        ("tpot:50", 2),
        ("e2el:350 ttft:1000", 2),
        ("e2el:100", 0),
    ],
)
def test_goodput(spec, good):
    m = compute_metrics(_results(), 2.0, goodput=parse_goodput(spec))
    assert m.request_goodput == pytest.approx(good / 2.0)


def test_parse_goodput():
    assert parse_goodput("ttft:500,tpot:50") == {"ttft": 500.0, "tpot": 50.0}
    assert parse_goodput("ttft:500 e2el:2000") == {"ttft": 500.0, "e2el": 2000.0}
    assert parse_goodput(None) == {}
    for bad in ("itl:5", "ttft", "ttft:fast", "tpot:-1"):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    assert count_good({}, {"ttft": [1.0]}) is None


def test_max_in_flight():
    assert max_in_flight(_results()) == 3  # at t = 0.15: [0, 0.2], [0.1, 0.4], [0.15, 0.55]
    back_to_back = [
        RequestResult(1, True, start_time=0.0, latency=1.0),
        RequestResult(1, True, start_time=1.0, latency=1.0),
    ]
    assert max_in_flight(back_to_back) == 1


def test_arrivals():
    rng = np.random.default_rng(0)
    assert arrival_offsets(5, float("inf"), 1.0, rng).tolist() == [0.0] * 5
    t = arrival_offsets(20_000, 4.0, 1.0, np.random.default_rng(1))
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # Poisson: CV = 1
    regular = np.diff(arrival_offsets(20_000, 4.0, 4.0, np.random.default_rng(1)))
    assert regular.mean() == pytest.approx(0.25, rel=0.03)
    assert regular.std() / regular.mean() == pytest.approx(0.5, rel=0.05)  # CV = 1/sqrt(k)
    same = arrival_offsets(10, 2.0, 1.0, np.random.default_rng(7))
    assert same.tolist() == arrival_offsets(10, 2.0, 1.0, np.random.default_rng(7)).tolist()
    with pytest.raises(ValueError):
        arrival_offsets(3, 1.0, 0.0, rng)


def test_parse_rates():
    assert parse_rates("2,8,inf") == [2.0, 8.0, float("inf")]
    for bad in ("0", "-1", "fast"):
        with pytest.raises(ValueError):
            parse_rates(bad)


class MergingTokenizer:
    """Letters a..z are tokens 3..28 (0-2 special); encode merges "ab" into one token (29)."""

    vocab_size = 30
    all_special_ids = [0, 1, 2]

    def decode(self, ids, skip_special_tokens=True):
        return "".join("ab" if i == 29 else chr(ord("a") + i - 3) for i in ids if i > 2)

    def encode(self, text, add_special_tokens=True):
        out, i = [], 0
        while i < len(text):
            if text.startswith("ab", i):
                out.append(29)
                i += 2
            else:
                out.append(ord(text[i]) - ord("a") + 3)
                i += 1
        return out


def test_random_text_prompts_have_exact_lengths_and_share_the_prefix():
    tok = MergingTokenizer()
    reqs = datasets.random_requests(tok, 20, 40, 7, prefix_len=12, seed=3)
    assert all(r.prompt_len == 52 and len(tok.encode(r.prompt)) == 52 for r in reqs)
    assert all(r.output_len == 7 for r in reqs)
    prefixes = {r.prompt[:10] for r in reqs}
    assert len(prefixes) == 1
    assert len({r.prompt for r in reqs}) == 20


def test_random_ids_lengths_range_and_seed():
    tok = MergingTokenizer()
    reqs = datasets.random_requests(
        tok, 200, 100, 50, range_ratio=0.5, seed=1, prefix_len=4, as_token_ids=True
    )
    ins = [r.prompt_len for r in reqs]
    outs = [r.output_len for r in reqs]
    assert all(len(r.prompt) == r.prompt_len for r in reqs)
    assert min(ins) >= 54 and max(ins) <= 154 and len(set(ins)) > 20
    assert min(outs) >= 25 and max(outs) <= 75
    assert all(t not in (0, 1, 2) for r in reqs for t in r.prompt)
    assert len({tuple(r.prompt[:4]) for r in reqs}) == 1
    again = datasets.random_requests(
        tok, 200, 100, 50, range_ratio=0.5, seed=1, prefix_len=4, as_token_ids=True
    )
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    with pytest.raises(ValueError):
        datasets.sample_lengths(np.random.default_rng(0), 3, 10, 1.0)


def test_jsonl(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "abc"}, {"prompt": [5, 6], "output_len": 3}, {"prompt": "xyz"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    reqs = datasets.jsonl_requests(str(path), MergingTokenizer(), 2, 9)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in reqs] == [("abc", 2, 9), ([5, 6], 2, 3)]
    path.write_text('{"prompt": "a", "output_len": 0}\n')
    with pytest.raises(ValueError, match="p.jsonl:1"):
        datasets.jsonl_requests(str(path), MergingTokenizer(), 2, 9)
    with pytest.raises(FileNotFoundError):
        datasets.jsonl_requests(str(tmp_path / "nope"), MergingTokenizer(), 2, 9)


def test_records_follow_performance_md():
    m = compute_metrics(_results(), 2.0, goodput={"ttft": 250.0})
    args = argparse.Namespace(
        workload="W3",
        served_model="m",
        endpoint="/v1/completions",
        dataset="random",
        input_len=128,
        output_len=32,
        range_ratio=0.0,
        prefix_len=0,
        ignore_eos=True,
        seed=0,
        metadata=["dtype=float32", "tp=1"],
        burstiness=1.0,
        max_concurrency=None,
        num_prompts=4,
        goodput="ttft:250",
    )
    rows = report.serve_records(args, [RunResult(2.0, m, []), RunResult(float("inf"), m, [])])
    by = {(r["request_rate"], r["metric"]): r for r in rows}
    for key in ("workload", "model", "dtype", "tp", "gpu", "commit", "date", "command"):
        assert key in rows[0]
    assert by[("2", "ttft_ms_p50")]["value"] == pytest.approx(200)
    assert by[("inf", "tpot_ms_p99")]["value"] == pytest.approx(99.3333, abs=1e-3)
    assert by[("2", "e2e_ms_mean")]["value"] == pytest.approx(300)
    assert by[("2", "output_tok_s")]["value"] == pytest.approx(3.5)
    assert by[("2", "goodput_request_s")]["value"] == pytest.approx(1.0)
    assert rows[0]["dtype"] == "float32"
    json.dumps(rows)  # plain JSON (no inf)


def test_token_id_prompts_without_a_tokenizer():
    from lightwell.bench.serve import IdsOnly

    reqs = datasets.random_requests(IdsOnly(1000), 5, 12, 3, prefix_len=4, as_token_ids=True)
    assert len(reqs) == 5
    for r in reqs:
        assert len(r.prompt) == 16 and all(0 <= t < 1000 for t in r.prompt)
    assert len({tuple(r.prompt[:4]) for r in reqs}) == 1  # the shared prefix
