"""bench/join_balance.py (issue 45 item 4): its figures as plain functions of made-up
samples, and its smoke run (real DNS server, listening workers, frontend) checked for
figures that agree with each other. No timing is asserted: the figures are the bench's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.join_balance import (Samples, analyse, emptied_for_good, event_time, first_time,
                                largest_gap, last_increase, log_events, per_second, within,
                                worker_indexes)

ROOT = Path(__file__).resolve().parent.parent
A, B, C = "127.0.0.2:7100", "127.0.0.3:7100", "127.0.0.4:7100"


def test_first_time_counts_from_the_change_and_skips_earlier_samples():
    samples = [(9.0, 5), (10.5, 0), (11.0, 3), (12.0, 4)]
    assert first_time(samples, 10.0, lambda n: n > 2) == 1.0
    assert first_time(samples, 8.0, lambda n: n > 2) == 1.0  # (9.0's 5 is at or after 8)
    assert first_time(samples, 10.0, lambda n: n > 9) is None


def test_last_increase_is_the_last_rise_after_the_change():
    routed = [(9.0, {0: 4.0}, 0), (10.2, {0: 6.0}, 0), (10.4, {0: 7.0}, 1),
              (10.6, {0: 7.0}, 1), (11.0, {0: 7.0}, 1)]
    assert abs(last_increase(routed, 10.0, 0) - 0.4) < 1e-9
    assert last_increase(routed, 10.5, 0) == 0.0  # (none after)
    assert last_increase(routed, 10.0, 1) == 0.0  # (an index never routed to)


def test_emptied_for_good_is_from_the_last_run_of_zeros():
    held = [(9.0, {A: 0}), (10.2, {A: 0}), (10.4, {A: 2}), (10.6, {A: 0}), (10.9, {A: 0})]
    assert abs(emptied_for_good(held, 10.0, A) - 0.6) < 1e-9
    assert emptied_for_good(held + [(11.0, {A: 1})], 10.0, A) is None
    assert abs(emptied_for_good(held, 10.0, B) - 0.2) < 1e-9  # (never held any)


def test_within_ten_percent_of_the_fair_share():
    assert within(11.0, 12.0) and within(13.2, 12.0) and within(12.0, 12.0)
    assert not within(10.7, 12.0) and not within(13.3, 12.0)


def test_per_second_means_the_held_counts_and_counts_the_routed_rise():
    held = [(10.1, {A: 2, B: 0}), (10.6, {A: 4, B: 1}), (11.2, {A: 3, B: 3})]
    routed = [(9.9, {0: 10.0}, 0), (10.3, {0: 12.0, 1: 1.0}, 1), (10.9, {0: 15.0, 1: 2.0}, 1),
              (11.5, {0: 16.0, 1: 6.0}, 1)]
    rows = per_second(held, routed, 10.0, 3, [A, B], {A: 0, B: 1})
    assert rows[0] == {"second": 0, "held": {A: 3.0, B: 0.5}, "routed": {A: 5.0, B: 2.0}}
    assert rows[1] == {"second": 1, "held": {A: 3.0, B: 3.0}, "routed": {A: 1.0, B: 4.0}}
    assert rows[2] == {"second": 2, "held": {A: None, B: None}, "routed": {A: None, B: None}}


def test_worker_indexes_come_from_the_frontends_join_lines():
    log = ("2026-12-04 05:00:00 INFO server.discovery: worker 0 (127.0.0.2:7100) joins the "
           "pool\n... worker 1 (127.0.0.3:7100) joins the pool\n"
           "... worker 0 (127.0.0.2:7100) left discovery: draining (3 requests)\n")
    assert worker_indexes(log) == {A: 0, B: 1}


def test_log_events_put_the_frontends_json_lines_on_our_clock():
    text = ('{"time": "2026-12-04T05:00:01.250Z", "level": "INFO", "logger": '
            '"server.discovery", "message": "worker 2 (127.0.0.4:7100) joins the pool"}\n'
            "not json\n"
            '{"time": "2026-12-04T05:00:03.000Z", "level": "INFO", "message": "worker 0 '
            '(127.0.0.2:7100) left discovery: draining (3 requests)"}\n')
    wall = 1796360400.0  # 2026-12-04T05:00:00Z
    events = log_events(text, wall - 100.0)  # (perf_counter read 100.0 then)
    assert [round(t, 3) for t, _ in events] == [101.25, 103.0]
    assert event_time(events, 100.5, f"({C}) joins the pool") == 0.75
    assert event_time(events, 100.5, f"({A}) left discovery") == 2.5
    assert event_time(events, 102.0, f"({C}) joins the pool") is None


def test_largest_gap_between_samples_in_a_window():
    samples = [(1.0, 0), (1.5, 0), (3.0, 0), (3.2, 0), (9.0, 0)]
    assert largest_gap(samples, 1.0, 3.2) == 1.5
    assert largest_gap(samples, 3.0, 3.1) is None


def test_analyse_takes_the_added_worker_last_and_the_dropped_one_first():
    class Args:
        streams, phase = 6, 2.0

    s = Samples()
    s.routed = [(0.5, {0: 3.0, 1: 3.0}, 0), (1.2, {0: 4.0, 1: 4.0, 2: 0.0}, 1),
                (1.4, {0: 4.0, 1: 4.0, 2: 2.0}, 1), (3.1, {0: 5.0, 1: 6.0, 2: 5.0}, 1),
                (3.3, {0: 5.0, 1: 7.0, 2: 6.0}, 2), (3.6, {0: 6.0, 1: 7.0, 2: 6.0}, 2)]
    s.held = [(0.5, {A: 3, B: 3, C: 0}), (1.5, {A: 2, B: 2, C: 2}), (3.4, {A: 0, B: 3, C: 3})]
    events = [(1.1, f"worker 2 ({C}) joins the pool"),
              (3.05, f"worker 0 ({A}) left discovery: draining (1 requests)"),
              (3.45, f"worker 0 ({A}) removed from the pool (0 requests move)")]
    result = analyse(s, events, Args, [A, B, C], {A: 0, B: 1, C: 2}, 1.0, 3.0)
    join, drop = result["join"], result["drop"]
    assert (result["added"], result["dropped"]) == (C, A)
    assert abs(join["resolved_s"] - 0.1) < 1e-9 and abs(join["first_request_s"] - 0.4) < 1e-9
    assert join["fair_share"] == 2.0 and abs(join["within_10pct_s"] - 0.5) < 1e-9
    assert join["peak"] == 2  # (before the drop: 3.4's 3 is after it)
    assert abs(drop["resolved_s"] - 0.05) < 1e-9 and abs(drop["removed_s"] - 0.45) < 1e-9
    # its last rise (3.6) came after the /metrics text with the answer (3.3): one request
    assert abs(drop["last_request_s"] - 0.6) < 1e-9 and drop["routed_after_answer"] == 1.0
    assert drop["fair_share"] == 3.0 and abs(drop["emptied_s"] - 0.4) < 1e-9


def test_the_smoke_run_prints_figures_that_agree():
    """Every stream ends [DONE] with no error; the added worker is routed to after the
    frontend's answer changed the pool, the dropped one never after it; it empties."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "join_balance.py"), "--smoke"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)
    output = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, output
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    text = "\n".join(lines[:-1])
    assert "--dns-min-interval" in text and "ended with [DONE]" in text, output
    load = result["load"]
    assert load["sent"] > 0 and load["done"] == load["sent"], output
    assert load["error_events"] == 0 and load["http_errors"] == 0, output
    addresses = result["addresses"]
    assert sorted(result["indexes"]) == sorted(addresses), output
    assert len(set(result["indexes"].values())) == len(addresses), output
    join, drop = result["join"], result["drop"]
    # (the log's times are cut to the millisecond)
    assert 0 <= join["resolved_s"] <= join["first_request_s"] + 0.001, output
    assert join["fair_share"] * len(addresses) == drop["fair_share"] * (len(addresses) - 1)
    added, dropped = result["added"], result["dropped"]
    assert added != dropped and {added, dropped} <= set(addresses), output
    assert sum(row["routed"][added] or 0 for row in join["seconds"]) > 0, output
    assert any(row["held"][added] for row in join["seconds"]), output
    # retired at the answer that dropped it: nothing routed to it after that; drained
    assert drop["routed_after_answer"] == 0, output
    assert drop["resolved_s"] is not None and drop["removed_s"] >= drop["resolved_s"], output
    assert drop["emptied_s"] is not None, output
