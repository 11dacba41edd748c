"""The seeded fault explorer (issue #55, `workers.sim`): its seeds hold the invariants on SQLite, a seed replays
exactly, the checker catches a duplicated, a missing and a stray row, and `tokenmill sim` reports and exits as
documented. Seeds that find a known bug are kept as strict xfails: they flip when it is fixed."""

from __future__ import annotations

import time

import pytest

from storage.formats import ERRORS_KEY, MANIFEST_KEY, write_jsonl, write_manifest, write_part
from storage.models import Job, Shard
from tokenmill.cli import main
from workers.sim.checker import check_prefix
from workers.sim.engine import expected_text
from workers.sim.explore import explore, run_seed
from workers.sim.kernel import FaultProfile, Kernel
from workers.sim.plan import JobPlan

SEEDS = range(0, 204)  # 200 beside the seeds of FOUND, which run on their own
PATHS = {  # the #55 review's paths the explorer found and that are not fixed yet (docs/fault-explorer.md)
}
KNOWN: dict[int, list[int]] = {  # seed -> the open paths it finds, on SQLite with the default settings
}
FOUND = {  # fixed path -> the seeds that found it (each seed's schedule shifts as the job code changes)
    5: [14, 64, 72, 156],  # a cancelled or expired batch's result files lacked the rows it never ran
    9: [422],  # a part whose PUT landed after a pause, once the sweep had removed it and forgotten its note
}
SEEDS_OF_FOUND = {seed for seeds in FOUND.values() for seed in seeds}


def test_the_seeds_hold_the_invariants() -> None:
    started = time.process_time()  # this process's CPU time (all its threads): not slowed by a busy machine
    summary = explore([seed for seed in SEEDS if seed not in KNOWN and seed not in SEEDS_OF_FOUND])
    seconds = time.process_time() - started
    assert summary.runs >= 200
    assert not summary.failures, "\n".join(f"seed {o.seed}: {o.violations}" for o in summary.failures)
    # #55 asks for 200 seeds in 60 s: 40-50 s of CPU on a Zen 4 EPYC, 60-64 s on a 2-core Zen 3 (AVX2) one, whose
    # timings also drift +-10 % from run to run; the bound catches a run that doubles, not that drift
    assert seconds < 80, f"{summary.runs} seeds took {seconds:.0f} s of CPU"


@pytest.mark.parametrize("seed", [
    pytest.param(seed, marks=pytest.mark.xfail(strict=True, reason="#55 " + "; ".join(PATHS[p] for p in paths)))
    for seed, paths in KNOWN.items()] + sorted(SEEDS_OF_FOUND))
def test_seeds_that_found_a_path(seed: int) -> None:
    """The seeds that found a path: strict xfails while it is open, passing once it is fixed."""
    outcome = run_seed(seed)
    assert outcome.ok, outcome.violations


def test_a_seed_replays_exactly() -> None:
    """The same seed: the same faults at the same simulated times, the same ends, the same violations."""
    for seed in (5, 7):
        first, again = run_seed(seed), run_seed(seed)
        assert len(first.schedule) > 1
        assert (first.schedule, first.statuses, first.violations, first.simulated_s) == (
            again.schedule, again.statuses, again.violations, again.simulated_s)


def test_seeds_draw_different_faults() -> None:
    profiles = {repr(Kernel(seed, FaultProfile()).rng.random()) for seed in range(5)}
    schedules = {tuple(run_seed(seed).schedule) for seed in range(3)}
    assert len(profiles) == 5 and len(schedules) == 3



def test_some_seeds_gather_their_faults_on_one_family_of_seams() -> None:
    """About 30 % of the seeds pause far more often at one family of seams (a cleanup's deletes, say), the rest
    keep their profile as drawn; a focused seed's schedule names its focus."""
    import random

    from workers.sim.kernel import FOCUS_FAMILIES

    base = FaultProfile(pause=0.01, crash=0.02)
    profiles = [base.focused(random.Random(f"focus-{seed}")) for seed in range(400)]
    focused = [p for p in profiles if p.focus]
    assert 80 < len(focused) < 160 and {p.focus for p in focused} == set(FOCUS_FAMILIES)
    assert all(p == base for p in profiles if not p.focus)
    deletes = next(p for p in focused if p.focus == "store delete")
    assert deletes.pause_at("store delete") == deletes.focus_pause >= 0.1
    assert deletes.pause_at("store put") == 0.01 and deletes.crash_at("store put") == 0.02
    seed = next(s for s in range(400) if FaultProfile().focused(random.Random(f"focus-{s}")).focus)
    assert any("faults gather at the" in entry for entry in run_seed(seed).schedule)

# ---- the checker over hand-made outputs ---------------------------------------------------------------

JOB_ID = "00000000-0000-0000-0000-000000000001"


def records(plan: JobPlan, rows: range) -> list[dict]:
    return [{"custom_id": plan.custom_ids[row], "text": expected_text(plan.custom_ids[row]), "finish_reason": "stop",
             "prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 0, "ttft_ms": None, "latency_ms": None,
             "row_index": row, "endpoint": "/v1/completions", "logprobs": None, "choice_index": 0} for row in rows]


def completed_job(parts: list[tuple[int, range]], listed: list[int] | None = None,
                  text: str | None = None) -> tuple[dict, list]:
    """A completed job of 4 rows whose part files hold `parts` (shard index, rows); the manifest lists the parts
    of `listed` (default: all), and every row's text is `text` when given."""
    kernel = Kernel(0, FaultProfile())
    plan = JobPlan(0, rows=4, shard_size=2, window="24h", arrives_at=0.0, openai_output=False, job_id=JOB_ID)
    store = kernel.store(plan.output_uri)
    job = Job(id=JOB_ID, status="completed")
    keys = []
    for index, rows in parts:
        rows_out = records(plan, rows)
        if text is not None:
            rows_out = [{**row, "text": text} for row in rows_out]
        keys.append(write_part(store, index, rows_out, JOB_ID, 1))
    job.shards = [Shard(index=index, status="completed", output_key=key) for (index, _), key in zip(parts, keys,
                                                                                                       strict=True)]
    wanted = keys if listed is None else [keys[i] for i in listed]
    write_jsonl(store, ERRORS_KEY, [])
    write_manifest(store, {"job_id": JOB_ID, "files": {"parts": [{"key": key} for key in wanted]}})
    return kernel.objects[plan.output_uri], [(plan, job)]


def test_the_checker_passes_a_complete_output() -> None:
    assert check_prefix(*completed_job([(0, range(0, 2)), (1, range(2, 4))])) == []


def test_the_checker_finds_a_row_written_twice() -> None:
    problems = check_prefix(*completed_job([(0, range(0, 2)), (1, range(1, 4))]))
    assert any("invariant 1" in p and "more than once" in p and "j0-r001" in p for p in problems), problems


def test_the_checker_finds_a_missing_row() -> None:
    problems = check_prefix(*completed_job([(0, range(0, 2)), (1, range(2, 3))]))
    assert any("invariant 1" in p and "missing" in p and "j0-r003" in p for p in problems), problems


def test_the_checker_finds_a_part_outside_the_manifest() -> None:
    problems = check_prefix(*completed_job([(0, range(0, 2)), (1, range(2, 4))], listed=[0]))
    assert any("invariant 4" in p and "outside the manifest" in p for p in problems), problems


def test_the_checker_finds_a_text_not_of_its_row() -> None:
    problems = check_prefix(*completed_job([(0, range(0, 4))], text="echo-someone-else"))
    assert any("not the engine's" in p for p in problems), problems


def test_the_checker_finds_a_deleted_manifest() -> None:
    objects, jobs = completed_job([(0, range(0, 4))])
    del objects[MANIFEST_KEY]
    assert any("invariant 5" in p and "manifest is gone" in p for p in check_prefix(objects, jobs))


# ---- the command ----------------------------------------------------------------------------------------

class NoRows:
    """An input with no rows: what path 5 amounted to (a cancelled batch listed none of the rows it never ran)."""
    num_rows = 0

    def read(self, start: int, end: int):
        return iter(())

    def close(self) -> None:
        pass


def test_the_command_reports_a_failing_seed_and_its_replay(capsys, monkeypatch) -> None:
    from ingest.openai_api import results

    monkeypatch.setattr(results, "open_input", lambda *args, **kwargs: NoRows())  # path 5, put back
    seed = FOUND[5][1]
    assert main(["sim", "--seed", str(seed)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("runs=1 violations=1 runs/s=")
    assert any(KNOWN_MARKS[5] in line for line in out)
    assert any("fault schedule:" in line for line in out)
    assert any(line.strip().endswith(f"tokenmill sim --seed {seed} --workers 3") for line in out)


def test_the_command_runs_seeds_and_ends_with_its_summary(capsys) -> None:
    assert main(["sim", "--seeds", "3", "--workers", "2"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("runs=3 violations=0 runs/s=")



# the violation each known path shows as (PostgreSQL's seeds differ from SQLite's: its own statements draw faults)
KNOWN_MARKS = {5: "in neither its output nor its error file"}


def test_seeds_run_on_postgresql(pg_databases) -> None:
    """On PostgreSQL (tables emptied per seed): a seed replays exactly, and what breaks is only what is known."""
    url = pg_databases()
    summary = explore(range(0, 5), database_url=url)
    assert summary.runs == 5
    unknown = [v for o in summary.failures for v in o.violations if not any(m in v for m in KNOWN_MARKS.values())]
    assert not unknown, unknown
    first, again = (explore([5], database_url=url).last for _ in range(2))
    assert (first.schedule, first.statuses, first.violations) == (again.schedule, again.statuses, again.violations)
