"""`ampatch tune`: the candidates worth trying, the timing rule (faster only beyond the spread
between repeats, ties to the simpler policy), and the choice, on hand-made measurements."""
from __future__ import annotations

import dataclasses
import io

import pytest
from _reports import report

from ampatch.cli.tune import tolerance
from ampatch.machine import hardware
from ampatch.runs.runner import LevelRun
from ampatch.runs.stats import RunStats
from ampatch.runs.verdict import Decider, Rule, growth_probes, judge
from ampatch.tune import timing
from ampatch.tune.candidates import REFERENCE, Candidate, initial
from ampatch.tune.measure import Job, Measured
from ampatch.tune.report import render, to_json
from ampatch.tune.search import Search

O0_LOSSES = [3.0 - 0.1 * i for i in range(10)]


def _row(level: str, losses: list[float], base: RunStats | None = None, skipped=(), ok: bool = True) -> RunStats:
    rep = {"opt_level": level, "losses": losses, "skipped_steps": list(skipped), "step_times_s": [0.1] * 5}
    return RunStats.of(LevelRun(level, ok, None if ok else "boom", 0, 1.0, report(rep) if ok else None), base)


def _measured(c: Candidate, losses: list[float], base: RunStats, tol: float = 0.02) -> Measured:
    row = _row(c.opt_level, losses, base)
    v = judge(row, Rule(tol), base.reference())
    return Measured(c, row, v.qualifies, v.reason, v.finite, v.deviation, learned=v.learned, noise=v.noise)


def _search(timings: dict[Candidate, list[float]], deviations: dict[Candidate, float]) -> Search:
    s = Search(Job(lambda n: [], 1), [], 0.02, None, io.StringIO())
    base = _row("O0", O0_LOSSES)
    s.result.reference = Measured(REFERENCE, base, True, "reference", True, 0.0)
    for c, dev in deviations.items():
        s.result.candidates.append(_measured(c, [x * (1 + dev) for x in O0_LOSSES], base))
    s.result.timings = {c.label: v for c, v in timings.items()}
    s.retimed = [c for c in timings if c != REFERENCE]
    return s


def test_the_candidates_on_a_cpu_without_native_float16_are_bfloat16_only(monkeypatch):
    # a CPU like most: bfloat16 native or not, no float16 path (this test must not depend on the machine)
    no_fp16 = dataclasses.replace(hardware.describe("cpu"), native={"bfloat16": True, "float16": False})
    monkeypatch.setattr(hardware, "describe", lambda device="cpu": no_fp16)
    cands = initial(["O1", "O2", "O3", "O4", "O5"], "cpu", None)
    assert [(c.opt_level, c.half_dtype) for c in cands] == [("O1", "bfloat16"), ("O2", "bfloat16"), ("O3", "bfloat16"),
                                                             ("O4", "bfloat16"), ("O5", "bfloat16")]
    asked = initial(["O1", "O5"], "cpu", "float16")
    assert [(c.opt_level, c.half_dtype) for c in asked] == [("O1", "float16")]   # O5 is bfloat16 by definition


def test_the_verdict_names_its_reason():
    base = _row("O0", O0_LOSSES)             # falls 0.5 (first 5 losses' mean minus the last 5's)
    ref, rule = base.reference(), Rule(0.02)
    ok = judge(_row("O1", O0_LOSSES, base), rule, ref)
    assert (ok.qualifies, ok.reason, ok.learned) == (True, "deviation 0.00% within 2.00%", pytest.approx(1.0))
    far = judge(_row("O1", [x + 0.05 for x in O0_LOSSES], base), rule, ref)   # 0.05 off: 10% of O0's progress
    assert not far.qualifies and far.reason == "deviation 10.00% > tolerance 2.00%"
    nan = judge(_row("O1", O0_LOSSES[:3] + [float("nan")] * 7, base), rule, ref)
    assert not nan.qualifies and nan.reason == "loss not finite from step 3" and not nan.finite
    lagging = O0_LOSSES[:1] * 2 + O0_LOSSES[:8]      # two initial back-offs: the O0 curve, two updates late
    assert judge(_row("O1", lagging, base, skipped=[0, 1]), rule, ref).qualifies
    late = judge(_row("O1", O0_LOSSES, base, skipped=[0, 6]), rule, ref)
    assert not late.qualifies and "skipped after the loss scaler's first back-offs (first: 6)" in late.reason


def test_the_noise_of_a_runs_own_differences_from_O0_is_allowed_for_and_said():
    """Per-step differences from O0 that scatter (a half-precision forward's rounding) but
    follow O0's trend get a noise allowance from their own scatter, and the verdict says how
    far the deviation goes beyond it; a steady offset has no scatter and gets none; a scatter
    whose allowance alone exceeds the tolerance cannot be judged at that tolerance."""
    long = [3.0 - 0.005 * i for i in range(200)]          # O0 falls 0.875 (25-loss means at each end)
    base = _row("O0", long)
    ref = base.reference()
    jitter = [x + (0.004 if i % 2 else -0.004) for i, x in enumerate(long)]
    noisy = judge(_row("O1", jitter, base), Rule(0.02), ref)
    assert 0 < noisy.noise < 0.02 and noisy.beyond < noisy.deviation and noisy.qualifies
    assert noisy.reason.startswith(f"deviation {noisy.deviation:.2%} (") and "beyond its noise of" in noisy.reason
    steady = judge(_row("O1", [x + 0.05 for x in long], base), Rule(0.02), ref)
    assert steady.noise == 0 and not steady.qualifies and steady.reason == "deviation 5.71% > tolerance 2.00%"
    loud = judge(_row("O1", [x + (0.04 if i % 2 else -0.04) for i, x in enumerate(long)], base), Rule(0.02), ref)
    assert not loud.qualifies and loud.reason.startswith("too noisy to judge at this tolerance")


def test_a_run_that_learns_nothing_never_qualifies_whatever_the_tolerance():
    base = _row("O0", O0_LOSSES)
    stalled = judge(_row("O3", [3.0] * 10, base), Rule(10.0), base.reference())    # a 1000% tolerance
    assert not stalled.qualifies and stalled.learned == pytest.approx(0)
    assert stalled.reason.startswith("learns 0% of what O0 learns (between 50% and 200% needed, whatever the tolerance")
    # nor does one that learns a multiple of what O0 learns (examples/tune.py's ruined norm at 12 steps: 23219%)
    racing = judge(_row("O3", [3.0 - 0.3 * i for i in range(10)], base), Rule(10.0), base.reference())
    assert not racing.qualifies and racing.reason.startswith("learns 300% of what O0 learns (between 50% and 200%")


def test_a_loss_scalers_growth_probe_does_not_fail_a_long_float16_run():
    """After 2000 clean steps a dynamic scale doubles; if the doubled scale overflows, that one
    step is skipped and the scale goes back: the scaler doing its job, not a failing candidate."""
    history = [[0, 65536.0], [0, 32768.0], [1, 16384.0], [2002, 32768.0], [2003, 16384.0]]
    assert growth_probes([0, 1, 2003], history) == {2003}
    assert growth_probes([0, 1, 2003, 2004], history + [[2004, 8192.0]]) == set()   # a streak: not a probe
    o0 = [3.0 - 0.0002 * i for i in range(2100)]
    base = _row("O0", o0)
    half = o0[:2] + o0[:2098]            # two initial back-offs, then O0's curve two updates late

    def row(skipped, hist):
        rep = {"opt_level": "O1", "losses": half, "skipped_steps": skipped, "step_times_s": [0.1] * 5,
               "steps": 2100, "loss_scale_history": {"loss_scaler0": hist}}
        return RunStats.of(LevelRun("O1", True, None, 0, 1.0, report(rep)), base)
    probed = judge(row([0, 1, 2003], history), Rule(0.02), base.reference())
    assert probed.qualifies, probed.reason
    unexplained = judge(row([0, 1, 1500], history[:3] + [[1500, 8192.0]]), Rule(0.02), base.reference())
    assert not unexplained.qualifies and "(first: 1500)" in unexplained.reason


def test_the_timing_rule():
    assert timing.order("O0", ["A", "B"], 2) == ["O0", "A", "B", "O0", "A", "B"]
    times = {"O0": [100.0, 110.0, 105.0], "A": [80.0, 82.0]}
    assert timing.spread(times) == pytest.approx(10 / 105)
    assert timing.spread({"A": [80.0, 80.0]}) == timing.MIN_SPREAD
    assert timing.faster(80, 100, 0.1) and not timing.faster(95, 100, 0.1)


def test_a_tie_within_the_spread_goes_to_the_simpler_policy():
    o1, o5 = Candidate("O1", "bfloat16"), Candidate("O5", "bfloat16", ("head",))
    s = _search({REFERENCE: [100.0, 104.0], o1: [70.0, 72.0], o5: [68.0, 70.0]}, {o1: 0.0, o5: 0.0})
    s.choose()
    assert s.result.chosen == o1 and "within the" in s.result.why and "simpler" in s.result.why


def test_a_policy_faster_beyond_the_spread_wins():
    o1, o5 = Candidate("O1", "bfloat16"), Candidate("O5", "bfloat16")
    s = _search({REFERENCE: [100.0, 101.0], o1: [90.0, 91.0], o5: [60.0, 61.0]}, {o1: 0.0, o5: 0.0})
    s.choose()
    assert s.result.chosen == o5 and s.result.why.startswith("the fastest policy that trains like FP32 (1.66x")


def test_without_a_qualifying_half_policy_O0_is_chosen_and_said_so():
    o1 = Candidate("O1", "bfloat16")
    s = _search({REFERENCE: [100.0]}, {o1: 0.5})
    s.retimed = []
    s.choose()
    assert s.result.chosen == REFERENCE and "no half policy trains like FP32" in s.result.why
    data = to_json(s.result)
    assert data["chosen"]["opt_level"] == "O0" and data["candidates"][0]["qualifies"] is False
    assert set(data["candidates"][0]) >= {"opt_level", "half_dtype", "keep_fp32", "loss_scale", "step_ms", "speedup",
                                          "deviation", "finite", "qualifies", "reason"}
    assert "chosen: O0: no half policy" in render(s.result, "title", None, "")


def test_O0_wins_when_every_half_policy_is_slower_beyond_the_spread():
    o1 = Candidate("O1", "bfloat16")
    s = _search({REFERENCE: [50.0, 51.0], o1: [100.0, 101.0]}, {o1: 0.0})
    s.choose()
    assert s.result.chosen == REFERENCE and "slower than O0" in s.result.why


@pytest.mark.parametrize("text,value", [("2%", 0.02), ("0.5 %", 0.005), ("0.03", 0.03), (".1", 0.1)])
def test_tolerance_parses(text, value):
    assert tolerance(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["-2%", "0", "two percent", "2%%", ""])
def test_a_bad_tolerance_is_refused(text):
    import argparse
    with pytest.raises(argparse.ArgumentTypeError):
        tolerance(text)


def test_only_the_interleaved_repeats_set_the_spread_and_the_finalists_times():
    """The first timing of O0 ran alone, in a busy minute: it does not count once the
    finalists have been re-timed side by side with O0."""
    o1 = Candidate("O1", "bfloat16")
    s = _search({REFERENCE: [900.0, 470.0, 456.0], o1: [267.0, 290.0, 280.0]}, {o1: 0.0})
    s.result.repeats = {REFERENCE.label: [470.0, 456.0], o1.label: [290.0, 280.0]}
    s.choose()
    assert s.result.spread == pytest.approx(max(14 / 463, 10 / 285))
    assert s.result.step_ms(REFERENCE) == pytest.approx(463) and s.result.chosen == o1
    assert "O0: 470/456" in render(s.result, "title", None, "")


@pytest.mark.parametrize("stop,signum", [(KeyboardInterrupt(), 2), ("SIGTERM", 15)])
def test_an_interrupted_search_records_the_signal_that_stopped_it(monkeypatch, stop, signum):
    """Ctrl-C and SIGTERM/SIGHUP (process.Stopped) end the search with what was measured; the
    command exits 128+N from `Result.interrupted`, as compare does."""
    import signal as signals

    from ampatch.runs import process
    exc = process.Stopped(getattr(signals, stop)) if isinstance(stop, str) else stop
    s = Search(Job(lambda n: [], 1), [], 0.02, None, io.StringIO())

    def stopped():
        raise exc
    monkeypatch.setattr(s, "_run", stopped)
    result = s.run()
    assert result.interrupted == signum and result.chosen is REFERENCE
    assert any(signals.Signals(signum).name in note for note in result.notes)


def test_compare_keeps_the_finished_levels_when_the_policy_row_is_interrupted():
    """A signal during compare's --policy row stops only that row: the table still prints."""
    from ampatch.cli.compare import with_policy_row
    from ampatch.runs import process
    runs = ["O0 run"]

    def interrupted():
        raise process.Stopped(15)
    assert with_policy_row(runs, interrupted) == 15 and runs == ["O0 run"]
    assert with_policy_row(runs, lambda: "policy run") is None and runs == ["O0 run", "policy run"]


def test_a_tie_with_O0_goes_to_the_half_policy_and_the_why_line_says_so():
    """The one rule for O0 (docs/tune.md): O0 is chosen only when it is faster than the best
    qualifying half policy beyond the spread between repeats; a half policy within the spread of
    O0's ties with it, the tie goes to the half policy, and the why-line says so in those words."""
    o1 = Candidate("O1", "bfloat16")
    s = _search({REFERENCE: [100.0, 104.0], o1: [103.0, 106.0]}, {o1: 0.0})
    s.choose()
    assert s.result.chosen == o1
    assert "0.98x O0's speed, a tie with O0 within the 3.9% spread between repeats, which goes to the half policy" \
        in s.result.why


def test_a_finalist_whose_retiming_run_fails_no_longer_qualifies(monkeypatch):
    """Each interleaved re-timing run is judged again: a finalist that qualified at its first run
    but not on a repeat (a nondeterministic run) is not chosen, and its reason says why."""
    from ampatch.tune import search as search_module
    o1, o5 = Candidate("O1", "bfloat16"), Candidate("O5", "bfloat16")
    s = _search({REFERENCE: [100.0], o1: [50.0], o5: [60.0]}, {o1: 0.0, o5: 0.0})
    s.retimed, s.rounds = [], 1
    base = s.result.reference.row
    repeats = {REFERENCE: O0_LOSSES, o1: [x + 0.2 for x in O0_LOSSES], o5: O0_LOSSES}   # o1's repeat: 40% off
    monkeypatch.setattr(search_module, "run_candidate", lambda c, job, log, record=False: c)
    monkeypatch.setattr(search_module, "measured",
                        lambda c, done, ref, rule: _measured(c, repeats[c], base) if ref is not None else None)
    s.retime()
    m1 = s.result.measured_of(o1)
    assert not m1.qualifies and m1.reason.startswith("its re-timing run 1 fails: deviation 40.00%")
    assert s.result.measured_of(o5).qualifies and s.retimed == [o1, o5]
    s.choose()
    assert s.result.chosen == o5


def test_the_budget_counts_the_recorded_runs_of_repairs(monkeypatch):
    """A repair starts with a recorded run (the diagnose recorder's FP32 shadows make it slower
    than a plain run): it is not started when its estimate does not fit what is left."""
    import time as clock

    from ampatch.tune import search as search_module
    c = Candidate("O3", "bfloat16")
    s = Search(Job(lambda n: [], 1), [], 0.02, 25.0, io.StringIO())
    s.last_wall = 10.0                                  # a plain run fits in the 25 s left, a recorded one does not
    recorded = []
    monkeypatch.setattr(search_module, "suggest", lambda *a: recorded.append(a))
    assert s.fits() and not s.fits(recorded=True)
    s.repair_one(c)
    assert recorded == [] and "budget reached before repairing O3 bfloat16" in s.result.notes[-1]
    s.deadline, s.record_wall = clock.time() + 25.0, 12.0   # once measured, the recorded run's own time counts
    assert s.fits(recorded=True) and s.estimate(recorded=True) == 12.0


def test_negative_rounds_are_refused():
    with pytest.raises(ValueError, match="rounds must be 0 or more"):
        Search(Job(lambda n: [], 1), [], 0.02, None, io.StringIO(), rounds=-1)


@pytest.mark.parametrize("kwargs,words", [
    ({"command": ["python", "x.py"], "workload": "lm"}, "apply to the built-in workloads"),
    ({"rounds": -1}, "rounds must be 0 or more"),
    ({"tolerance": 0.0}, "tolerance must be above 0"),
    ({"steps": 0}, "steps must be at least 1"),
    ({"levels": ["O9"]}, "Unknown opt_level"),
    ({"out": "/no/such/dir/p.json"}, "directory does not exist"),
])
def test_tune_from_python_refuses_bad_arguments_before_running_anything(kwargs, words):
    from ampatch.tune import tune
    log = io.StringIO()
    with pytest.raises(ValueError, match=words):
        tune(**kwargs, log=log)
    assert log.getvalue() == ""                      # nothing started


# ------------------------------------------------------------------ --objective memory
def _memory_search(footprints: dict[Candidate, tuple[float, float, float]]) -> Search:
    """A search with the memory objective over candidates given (bytes per param, deviation, step ms)."""
    s = Search(Job(lambda n: [], 1), [], 0.02, None, io.StringIO(), objective="memory")
    base = _row("O0", O0_LOSSES)
    ref_bytes, _, ref_ms = footprints.pop(REFERENCE)
    base = dataclasses.replace(base, train_bytes_per_param=ref_bytes)
    s.result.reference = Measured(REFERENCE, base, True, "reference", True, 0.0)
    s.result.timings = {REFERENCE.label: [ref_ms]}
    for c, (nbytes, dev, ms) in footprints.items():
        m = _measured(c, [x * (1 + dev) for x in O0_LOSSES], base)
        s.result.candidates.append(dataclasses.replace(m, row=dataclasses.replace(m.row, train_bytes_per_param=nbytes)))
        s.result.timings[c.label] = [ms]
    return s


def test_the_memory_objective_tries_the_low_memory_masters_and_chooses_the_fewest_bytes():
    cands = initial(["O1", "O2", "O3", "O5"], "cpu", "bfloat16", objective="memory")
    low = [c for c in cands if c.master_weights is not None and c.optimizer_states is None]  # with int8: their own test
    assert [(c.opt_level, c.master_weights) for c in low] == [("O5", "stochastic"), ("O5", "kahan")]
    assert not [c for c in initial(["O1", "O5"], "cpu", "bfloat16") if c.master_weights]   # speed: not tried
    with pytest.raises(ValueError, match="objective must be one of speed, memory"):
        initial(["O1"], "cpu", None, objective="size")
    o3, stoch, kahan, o5 = (Candidate("O3", "bfloat16"), Candidate("O5", "bfloat16", master_weights="stochastic"),
                            Candidate("O5", "bfloat16", master_weights="kahan"), Candidate("O5", "bfloat16"))
    # O3 fails (far from O0): the stochastic masters hold the least of what qualifies, though slower
    s = _memory_search({REFERENCE: (12.0, 0.0, 10.0), o3: (6.0, 0.5, 5.0), stoch: (10.0, 0.001, 9.0),
                        kahan: (12.0, 0.0, 8.0), o5: (14.0, 0.0, 6.0)})
    s.choose()
    assert s.result.chosen == stoch and "10.0 bytes per trained parameter" in s.result.why
    assert "against O0's 12.0" in s.result.why
    # the same footprint goes by speed: kahan (12 B) against O0 (12 B) and nothing smaller qualifies
    s = _memory_search({REFERENCE: (12.0, 0.0, 10.0), kahan: (12.0, 0.0, 5.0), o5: (14.0, 0.0, 4.0)})
    s.result.spread = None
    s.choose()
    assert s.result.chosen == kahan
    s = _memory_search({REFERENCE: (12.0, 0.0, 4.0), kahan: (12.0, 0.0, 10.0), o5: (14.0, 0.0, 3.0)})
    s.choose()
    assert s.result.chosen == REFERENCE and "no qualifying half policy holds fewer bytes" in s.result.why
    data = to_json(s.result)
    assert data["objective"] == "memory" and data["reference"]["train_bytes_per_param"] == 12.0
    assert {d["train_bytes_per_param"] for d in data["candidates"]} == {12.0, 14.0}
    shown = render(s.result, "t", None, "x")
    assert "B/param" in shown and "the objective is memory" in shown


def test_the_why_line_names_every_policy_that_looks_faster_than_the_one_chosen():
    """A tie within the spread goes to the simpler policy; the line names the policies whose
    step time is lower, with their speed-ups, so the choice never reads against the table."""
    o2, o4, o5 = Candidate("O2", "bfloat16"), Candidate("O4", "bfloat16"), Candidate("O5", "bfloat16")
    s = _search({REFERENCE: [100.0, 110.0], o2: [70.0, 72.0], o4: [74.0, 76.0], o5: [68.0, 71.0]},
                {o2: 0.0, o4: 0.0, o5: 0.0})
    s.result.repeats = {k: v for k, v in s.result.timings.items()}
    s.choose()
    assert s.result.chosen == o4                       # O4 is simpler than O2 and O5 (SIMPLICITY)
    why = s.result.why
    assert "O5 bfloat16 (1.51x), O2 bfloat16 (1.48x) show a higher speed-up" in why and "(1.40x O0" in why
    assert "tie, which goes to the simpler policy" in why


def test_a_simpler_policy_behind_the_fastest_three_is_re_timed_too():
    """O1 is the simplest policy: slower at its first timing than the three fastest, but within
    a tie it would win, so it is a finalist and re-timed beside them."""
    o1, o2, o3, o5 = (Candidate("O1", "bfloat16"), Candidate("O2", "bfloat16"), Candidate("O3", "bfloat16"),
                      Candidate("O5", "bfloat16"))
    s = Search(Job(lambda n: [], 1), [], 0.02, None, io.StringIO())
    base = _row("O0", O0_LOSSES)
    s.result.reference = Measured(REFERENCE, base, True, "reference", True, 0.0)
    for c, ms in ((o5, 0.06), (o3, 0.065), (o2, 0.07), (o1, 0.08)):
        m = _measured(c, O0_LOSSES, base)
        s.result.candidates.append(dataclasses.replace(m, row=dataclasses.replace(m.row, median_step_ms=ms)))
    assert [m.candidate for m in s.finalists()] == [o5, o3, o2, o1]
    s.result.candidates = s.result.candidates[:3]
    assert [m.candidate for m in s.finalists()] == [o5, o3, o2]


def test_cannot_tell_is_its_own_outcome_never_an_O0_policy():
    """Candidates the runs cannot tell, none qualifying: no policy is chosen (not O0 with 'no half
    policy trains like FP32'), the why-line says what would decide, the JSON says so."""
    o5 = Candidate("O5", "bfloat16")
    s = _search({REFERENCE: [100.0], o5: [80.0]}, {})
    row = _row("O5", O0_LOSSES, s.result.reference.row)
    s.result.candidates.append(Measured(o5, row, False, "too noisy to judge at this tolerance (2.00%): ...", True,
                                        0.3, noise=0.25, undecided=True, steps=40,
                                        decide=Decider(160, 0.25)))
    s.result.timings[o5.label] = [80.0]
    s.retimed = []
    s.choose()
    assert s.result.chosen is None and s.result.cannot_tell
    assert "cannot tell whether O5 bfloat16" in s.result.why and "a tolerance of 25.00%" in s.result.why
    data = to_json(s.result)
    assert data["outcome"] == "cannot tell" and data["chosen"] is None
    assert data["decide"] == {"steps": 160, "tolerance": 0.25} and data["candidates"][0]["outcome"] == "cannot tell"
    assert "cannot tell: cannot tell whether" in render(s.result, "t", None, "x")
