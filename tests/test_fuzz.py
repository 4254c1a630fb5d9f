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
from _fuzz_programs import differences, draw, oracle, planted, train_all

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


PLANT_SEEDS = list(range(0, 24))


@pytest.fixture(scope="module")
def plant_reference():
    return run_clean(oracle, PLANT_SEEDS, 7)


@pytest.mark.parametrize("bug", ["proof-says-local", "per-process-mean-loss", "dropped-gradient-sum"])
def test_the_seeds_catch_a_planted_bug(dist, plant_reference, bug):
    results = dist(2).run(planted, bug, PLANT_SEEDS, 7)
    for got in results:
        assert differences(plant_reference, got), f"the fuzzer missed the planted bug {bug!r}"


def test_the_programs_cover_the_grammar():
    from _fuzz_programs import OPS

    drawn = {op for world in SEEDS for seed in SEEDS[world][1] for op in draw(seed)}
    assert drawn == set(OPS), f"ops no CI seed draws: {sorted(set(OPS) - drawn)}"
    assert "batchnorm" in {op for seed in SEEDS_2D for op in draw(seed)}  # (its statistics on 2D: a bug found)
