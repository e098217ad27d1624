"""The reward pool: batched async grading, per-item time limits, errors, worker replacement.

One pool (2 workers, 3 s per item) serves most tests; its user reward function
(`rewards_user_fns:by_mode`) misbehaves on demand through the item's metadata.
"""

import asyncio
import time

import pytest

from megatron_darl.config.rewards import RewardConfig
from megatron_darl.rewards.api import RewardInput
from megatron_darl.rewards.pool import RewardPool
from tests.helpers.sandbox import needs_sandbox, sandbox_processes

TIMEOUT_S = 3.0
SPIN = "\\boxed{9^{9^{9^{9}}}}"  # sympy evaluates this tower for minutes


def math(response, gold):
    return RewardInput(prompt="q", response=response, kind="math", answer={"answer": gold})


def custom(mode, response="abcd"):
    return RewardInput(prompt="q", response=response, kind="custom", metadata={"mode": mode})


@pytest.fixture(scope="module")
def pool():
    config = RewardConfig(num_workers=2, timeout_s=TIMEOUT_S, fn="tests.helpers.reward_fns:by_mode",
                          code_cpu_s=2, code_wall_s=60, code_memory_mb=512)
    with RewardPool(config) as p:
        yield p


def test_mixed_batch_graded_in_order(pool):
    import reasoning_gym

    entry = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=5)[0]
    from megatron_darl.rewards.procedural_grader import procedural_payload

    proc = procedural_payload("basic_arithmetic", entry)
    items = [
        math("\\boxed{\\frac{1}{2}}", "0.5"),
        math("\\boxed{3}", "4"),
        RewardInput("q", f"<answer>{entry['answer']}</answer>", "procedural", proc),
        RewardInput("q", "<answer>nope</answer>", "procedural", proc),
        custom("length", "x" * 7),
        math("The answer is 12.", "12"),
        RewardInput("q", "#### 72", "math", {"ground_truth": "72"}),  # the data role's form
    ]
    results = pool.score(items)
    assert [r.status for r in results] == ["ok"] * 7
    assert [r.score for r in results] == [1.0, 0.0, 1.0, 0.0, 0.7, 1.0, 1.0]


@needs_sandbox
def test_code_item_through_the_pool(pool):
    payload = {"format": "stdio", "cases": [{"input": "2 3\n", "output": "5\n"}]}
    items = [RewardInput("q", "print(sum(map(int, input().split())))", "code", payload),
             RewardInput("q", "print(0)", "code", payload)]
    assert [r.score for r in pool.score(items)] == [1.0, 0.0]


def test_spinning_parser_is_cut_off_and_pool_keeps_working(pool):
    before = pool.metrics()["rollout/reward_timeouts"]
    pids = set(pool.worker_pids())
    start = time.monotonic()
    # a gold that is not a whole number: for one that is, the tower is refused unevaluated
    results = pool.score([math(SPIN, "\\frac{5}{2}"), math("\\boxed{7}", "7"), math("\\boxed{8}", "7")])
    elapsed = time.monotonic() - start
    assert results[0].status == "timeout" and results[0].score == 0.0
    assert [(r.status, r.score) for r in results[1:]] == [("ok", 1.0), ("ok", 0.0)]
    assert elapsed < TIMEOUT_S + 3  # the batch did not wait for the spinning item
    assert pool.metrics()["rollout/reward_timeouts"] == before + 1
    assert len(pids - set(pool.worker_pids())) == 1  # exactly the hung worker was replaced
    # the replacement grades normally
    assert [r.score for r in pool.score([math("\\boxed{2}", "2")] * 3)] == [1.0] * 3


def test_grader_errors_score_zero_and_are_counted(pool):
    pool.score([math("\\boxed{1}", "1")] * 2)  # the workers start on first use (this test may be the first)
    before = pool.metrics()["rollout/reward_errors"]
    pids = pool.worker_pids()
    assert len(pids) == 2
    results = pool.score([custom("raises"), custom("nan"), math("\\boxed{1}", "1"),
                          RewardInput("q", "x", "math", answer={})])
    assert [r.status for r in results] == ["error", "error", "ok", "error"]
    assert [r.score for r in results] == [0.0, 0.0, 1.0, 0.0]
    assert "on purpose" in results[0].detail and "finite float" in results[1].detail
    assert pool.metrics()["rollout/reward_errors"] == before + 3
    assert pool.worker_pids() == pids  # an ordinary grader error costs no restart


def test_crashing_and_hanging_user_functions_cost_one_item(pool):
    results = pool.score([custom("crashes"), custom("hangs"), custom("length")])
    assert (results[0].status, results[0].score) == ("error", 0.0)
    assert "worker died" in results[0].detail
    assert (results[1].status, results[1].score) == ("timeout", 0.0)
    assert (results[2].status, results[2].score) == ("ok", 0.4)
    assert pool.score([custom("length", "xy")])[0].score == pytest.approx(0.2)


@needs_sandbox
def test_hung_program_killed_with_its_worker(pool):
    payload = {"format": "stdio", "cases": [{"input": "", "output": ""}]}
    hang = "import os, time\nos.fork()\ntime.sleep(600)\n"  # two sleepers, under the 60 s wall
    result = pool.score([RewardInput("q", hang, "code", payload)])[0]
    assert result.status == "timeout"
    deadline = time.monotonic() + 5
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sandbox_processes() == []  # root: no sandbox uid left; a user: no PID namespace


def test_concurrent_batches_share_the_workers(pool):
    async def both():
        return await asyncio.gather(
            pool.ascore([math("\\boxed{1}", "1"), math("\\boxed{2}", "1")]),
            pool.ascore([custom("length", "x" * 3)] * 3),
        )

    first, second = asyncio.run(both())
    assert [r.score for r in first] == [1.0, 0.0]
    assert [r.score for r in second] == [pytest.approx(0.3)] * 3


def test_workers_grade_math_and_procedural_items_without_torch():
    # a worker reads one config section; through `megatron_darl.config` it used to import every
    # section, `algo`, and torch: 300 MB and seconds of start-up per worker (120 MB without)
    from megatron_darl.rewards.procedural_grader import procedural_payload

    payload = procedural_payload("chain_sum", {"question": "2 + 3 =", "answer": "5", "metadata": {}})
    items = [math("\\boxed{2}", "2"), RewardInput("q", "<answer>5</answer>", "procedural", payload)]
    with RewardPool(RewardConfig(num_workers=2)) as fresh:
        assert [r.score for r in fresh.score(items)] == [1.0, 1.0]
        pids = fresh.worker_pids()
        assert len(pids) == 2
        for pid in pids:
            with open(f"/proc/{pid}/maps", encoding="utf-8") as fh:
                assert "libtorch" not in fh.read(), f"reward worker {pid} loaded torch"


def test_bad_function_path_fails_at_start():
    with pytest.raises(ValueError, match="no_such_module"):
        RewardPool(RewardConfig(fn="no_such_module:f"))
    with pytest.raises(ValueError, match="no callable 'missing'"):
        RewardPool(RewardConfig(fn="tests.helpers.reward_fns:missing"))


def test_closed_pool_refuses_work():
    pool = RewardPool(RewardConfig(num_workers=1))
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.score([math("\\boxed{1}", "1")])


def test_config_check_names_every_bad_field():
    bad = RewardConfig(num_workers=0, timeout_s=-1, fn="not a path", code_memory_mb=16,
                       code_max_procs=0)
    fields = {name for name, _ in bad.check()}
    assert fields == {"num_workers", "timeout_s", "fn", "code_memory_mb", "code_max_procs"}
    with pytest.raises(ValueError, match="num_workers"):
        bad.validate()
    assert RewardConfig().check() == []


def test_reward_input_validates_and_round_trips():
    with pytest.raises(ValueError, match="kind"):
        RewardInput("q", "r", "poetry")
    item = RewardInput("q", "r", "math", {"answer": "1/2"}, {"group": 3})
    assert RewardInput.from_json(item.to_json()) == item
