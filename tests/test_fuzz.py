"""A differential fuzzer: random small programs (tests/_fuzz_programs.py: row-local layers,
layers that mix the batch's rows, views, residuals, tied weights), each trained on the seed's
Pattern 1 (the automatic data-parallel path decides what runs locally) at 2, 3 and 4
processes with uneven batches (7 rows over 2 and 3; 5 rows over 4, one process holding
none) and on a 2 x 2 ('data', 'model') mesh with the outer weights split over 'model',
against one device in a clean process. A fixed set of seeds runs in CI;
``--fuzz-n N`` adds N more per world size for a long run. The planted bugs show that these
seeds catch a wrong proof, a wrong loss weighting and a missing gradient sum."""

import pytest
from _clean import run_clean
from _fuzz_programs import OPS, PLANTED_IN, differences, draw, join_stages, oracle, planted, train_all, train_stages

#: world size -> (rows per batch, the CI seeds)
SEEDS = {2: (7, range(0, 40)), 3: (7, range(40, 80)), 4: (5, range(80, 112))}


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.smoke), 3, 4])
def test_fuzzed_programs_give_one_devices_result(dist, world, request):
    rows, fixed = SEEDS[world]
    extra = request.config.getoption("--fuzz-n")
    seeds = list(fixed) + list(range(1000 * world, 1000 * world + extra))
    ref = run_clean(oracle, seeds, rows)
    results = dist(world).run(train_all, seeds, rows, "pattern1")
    for rank, got in enumerate(results):
        found = differences(ref, got)
        assert not found, f"rank {rank}: " + "\n".join(found)


#: the 2D mesh ('data', 'model') of 2 x 2, the outer weights split over 'model' (Pattern 1 with
#: tensor parallelism): 7 rows
SEEDS_2D = list(range(0, 24))


def test_fuzzed_programs_on_a_2d_mesh_give_one_devices_result(dist, request):
    extra = request.config.getoption("--fuzz-n")
    seeds = SEEDS_2D + list(range(5000, 5000 + extra))
    ref = run_clean(oracle, seeds, 7)
    results = dist(4).run(train_all, seeds, 7, "pattern1-2d")
    for rank, got in enumerate(results):
        found = differences(ref, got)
        assert not found, f"rank {rank}: " + "\n".join(found)


#: FSDPv2 strategies: the whole program one unit ('fsdp' of 2, 7 rows), each op a unit of its
#: own inside it (3 processes, 7 rows: 3, 2, 2), and ('fsdp', 'model') = 2 x 2 with the outer
#: weights split over 'model' (7 rows: 4 and 3 over 'fsdp')
SEEDS_FSDP = {("fsdpv2", 2): range(0, 32), ("fsdpv2-nested", 3): range(32, 64), ("fsdpv2-2d", 4): range(64, 88)}


@pytest.mark.parametrize("strategy, world", list(SEEDS_FSDP))
def test_fuzzed_programs_under_fsdpv2_give_one_devices_result(dist, strategy, world, request):
    extra = request.config.getoption("--fuzz-n")
    seeds = list(SEEDS_FSDP[strategy, world]) + list(range(7000 + 1000 * world, 7000 + 1000 * world + extra))
    ref = run_clean(oracle, seeds, 7)
    results = dist(world).run(train_all, seeds, 7, strategy)
    for rank, got in enumerate(results):
        found = differences(ref, got)
        assert not found, f"rank {rank}: " + "\n".join(found)


def test_ops_between_a_tensor_parallel_pair_give_one_devices_result(dist):
    """Found by this fuzzer: fc_in column-parallel and fc_out row-parallel over 'model' are
    paired, and what runs between them (a softmax or a layer norm over the features, a view
    into heads) runs on each process's 3 of the 6 features: wrong values or a crash."""
    seeds = [s for s in range(200) if {"softmax-1", "layernorm", "heads"} & set(draw(s))][:6]
    ref = run_clean(oracle, seeds, 7)
    for rank, got in enumerate(dist(2).run(train_all, seeds, 7, "fsdpv2-2d-paired")):
        found = differences(ref, got)
        assert not found, f"rank {rank}: " + "\n".join(found)


#: pipeline stages ('pipeline' of 2, cut between the ops), 6 rows in 2 micro-batches of 3: the
#: first 20 programs whose ops are all row-local (the grammar draws mostly mixing ones) and 8 others
SEEDS_STAGES = [s for s in range(2000) if all(OPS[op][0] == "local" for op in draw(s))][:20] + list(range(8))


def test_fuzzed_programs_as_pipeline_stages_give_one_devices_result_or_are_refused(dist, request):
    """The stages compute each micro-batch on its own: a program proven to keep rows apart
    gives one device's result; any other is refused on every process, naming the operator.
    A program with none of the ops that mix rows must never be refused."""
    extra = request.config.getoption("--fuzz-n")
    seeds = SEEDS_STAGES + list(range(9000, 9000 + extra))  # (--fuzz-n: drawn as they come)
    ref = run_clean(oracle, seeds, 6)
    results = dist(2).run(train_stages, seeds, 6)
    refusal = "is not proven to compute each row from that row alone"
    for rank, got in enumerate(results):
        for seed in seeds:
            if isinstance(got[seed], str) and refusal in got[seed]:
                assert any(OPS[op][0] == "mix" for op in draw(seed)), f"rank {rank}: {got[seed]}"
                assert got[seed] == results[0][seed]  # (the same error everywhere)
    joined = join_stages(results)
    refused = [s for s in seeds if isinstance(joined[s], str) and refusal in joined[s]]
    found = differences({k: {s: v for s, v in ref[k].items() if s not in refused} for k in ref},
                        {s: v for s, v in joined.items() if s not in refused})
    assert not found, "\n".join(found)
    assert len(refused) <= 8  # (the row-local programs run)


PLANT_SEEDS = list(range(0, 24))


@pytest.fixture(scope="module")
def plant_reference():
    return run_clean(oracle, PLANT_SEEDS, 7)


@pytest.fixture(scope="module")
def plant_pool():
    """The planted bugs run in processes of their own, apart from the other tests' pool: a plant
    changes the engine inside the process while it runs."""
    from _pool import Pool

    pool = Pool(2)
    yield pool
    pool.close()


@pytest.mark.parametrize("bug", list(PLANTED_IN))
def test_the_seeds_catch_a_planted_bug(plant_pool, plant_reference, bug):
    results = plant_pool.run(planted, bug, PLANT_SEEDS, 7)
    for got in results:
        assert differences(plant_reference, got), f"the fuzzer missed the planted bug {bug!r}"


def test_the_programs_cover_the_grammar():
    from _fuzz_programs import OPS

    drawn = {op for world in SEEDS for seed in SEEDS[world][1] for op in draw(seed)}
    assert drawn == set(OPS), f"ops no CI seed draws: {sorted(set(OPS) - drawn)}"
    assert "batchnorm" in {op for seed in SEEDS_2D for op in draw(seed)}  # (its statistics on 2D: a bug found)
