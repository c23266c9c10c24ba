"""Sort the suite into lanes from measured test durations: ``tests/lanes.txt``.

``make test`` (CI) must finish in 8 minutes on 2 cores and ``make test-fast`` in 90 s
(issue 32). Which tests are heavy is measured, not guessed: run the suite once with every
duration printed, then let this script write the lanes file that ``tests/conftest.py`` reads::

    HF_HUB_OFFLINE=1 python -m pytest -q -n 2 --durations=0 -m "not bench" > durations.txt
    python benchmarks/suite_lanes.py durations.txt > tests/lanes.txt

Several files may be given, oldest first: a test's newest figure wins, so a run of ``make test``
(which no longer runs the bench lane) keeps the bench lane's tests at their last measured times.

The rule, in seconds of the durations file (setup, call and teardown of a test summed):

- **bench** (``make test-bench`` runs them, ``make test`` does not): of a parametrized test
  whose cases together take over ``--sweep`` seconds, every case but the cheapest one (the
  cheapest still runs in ``make test``, so each mechanism keeps a real-run check in CI); a
  single test over ``--single`` seconds.
- **slow** (``make test`` runs them, ``make test-fast`` does not): any other test over
  ``--slow`` seconds.

The coverage census (tests/test_coverage.py samples itself) and the property tests
(tests/test_fuzz.py runs a fixed, smaller number of examples) are left to their own files.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

# Files that choose their own lanes in code: the census's smoke sample, the fuzz examples, and the
# combination matrix's share (tests/combinations.py FAST: the cells that meet the most pairs first).
OWN_LANES = ("tests/test_coverage.py", "tests/test_fuzz.py", "tests/test_combinations.py")
# Cases the rule places wrongly, and the lane they belong in ("test": make test), with why.
_ZOO = "tests/test_accuracy_cpu.py::test_cpu_estimate_matches_measured_peak_within_2_percent[{}]"
_AMP = "tests/test_accuracy_cpu.py::test_amp_bf16_estimate_matches_a_real_cpu_autocast_run[{}-narrow]"
_FSDP = "tests/test_sharded.py::test_fsdp_estimate_matches_what_fsdp2_itself_allocates_on_a_cpu_rank[{}]"
OVERRIDES = {
    # the zoo's real-run comparison is the suite's core: its cases under about 10 s stay (an MLP, a
    # CNN with batch norm, two branches, an LSTM, GPT-2, DINOv2, CLIP)
    **{_ZOO.format(name): "test" for name in ("mlp", "cnn_bn", "two_branch", "lstm", "gpt2", "dinov2", "clip")},
    # autocast on a transformer at a width an AVX2 host runs in seconds (tests/zoo.py NARROW)
    **{_AMP.format(name): "test" for name in ("gpt2", "bert", "vit")},
    # the two cases share one module fixture whose cost lands on whichever runs first; the MLP is
    # the cheaper rank job on a quiet machine (21 s against 36 s)
    _FSDP.format("mlp"): "test",
    _FSDP.format("gpt2"): "bench",
    # the 7B QLoRA plans (a fix search at 7B scale, about a minute each) never ran in make test, so
    # no durations file has them: bench, whether measured or not
    "tests/test_verdict.py::test_the_readme_qlora_job_without_checkpointing_is_fixed_with_checkpointing_on_the_"
    "rtx_4090": "bench",
    "tests/test_verdict.py::test_the_readmes_examples_get_one_verdict_everywhere[qlora 7B RTX-4090]": "bench",
    # the one-verdict rule and the same-card fix search keep their tiny jobs in make test
    # (test_estimate_check_plan_and_preflight_give_the_same_verdict, a fix at another precision); the
    # README-scale and recipe sweeps (25-40 s each: a fix search at GPT-2 and Llama scale) are bench
    "tests/test_verdict.py::test_the_readmes_examples_get_one_verdict_everywhere[gpt2 RTX-4090]": "bench",
    "tests/test_verdict.py::test_no_fix_suggests_hardware_when_a_setting_fits[lora]": "bench",
    # the brief's 8 minutes for make test in a fresh virtualenv (8 min 30 s measured after this
    # session's merges): the cheapest kept case of these sweeps is still 9-18 s, and each mechanism
    # keeps a cheaper check in make test (HF checkpointing: test_checkpointing's T5 and the other
    # cases of test_checkpointing_full_matches_hf_checkpointing_measured; evaluation:
    # test_integrations_transformers; a Hub config's dtypes: the rest of test_weights_dtype)
    # the compiled trace's partition replay against a real run of the same partition: a strict xfail
    # (+3.6%, not found) of ~10 s while the compiled trace is off (memcheck/trace/compiled.py)
    "tests/test_compiled.py::test_the_compiled_trace_replays_the_min_cut_partition_of_a_real_run": "bench",
    # real gloo ranks of FSDP1 with CPU offload and of FSDP1/FSDP2 with 4-bit weights stored as bf16 (each a
    # spawn of 2 ranks with bitsandbytes or offload stubs); hand-arithmetic unit tests of both stay
    "tests/test_fsdp1_cpu.py::test_offload_keeps_the_device_sharded_gradients_as_fsdp1_does_on_cpu_ranks": "bench",
    "tests/test_sharded_qlora.py::test_fsdp1_with_4bit_weights_stored_as_bf16_matches_real_ranks": "bench",
    "tests/test_sharded_qlora.py::test_fsdp_with_4bit_weights_stored_as_bf16_matches_real_ranks": "bench",
    # a real torchrun of 2 gloo ranks (each under the profiler) beside the traced script: ~20 s quiet;
    # the launcher's parsing, the buckets' bytes and the clean-up stay in make test
    "tests/test_launch.py::test_a_ddp_script_under_torchrun_matches_its_real_ranks": "bench",
    "tests/test_strategies_cpu.py::test_eval_pass_matches_a_trainer_style_loop[0]": "bench",
    "tests/test_strategies_cpu.py::test_hf_checkpointing_in_user_code_matches_a_real_run[False]": "bench",
    "tests/test_strategies_cpu.py::test_checkpointing_full_matches_hf_checkpointing_measured[bert-True]": "bench",
    "tests/test_strategies_cpu.py::test_checkpointing_a_list_of_modules_matches_checkpointing_written_in_the_"
    "model[False]": "bench",
    "tests/test_weights_dtype.py::test_llama3_8b_hub_config_weights_follow_the_precision[fp32-auto-32121044992]":
        "bench",
    # progress: test_an_error_on_a_terminal_is_one_clean_line keeps the terminal in make test
    "tests/test_progress.py::test_no_progress_with_json_or_when_piped[piped-estimate]": "bench",
}
LINE = re.compile(r"([\d.]+)s (?:call|setup|teardown)\s+(tests/\S.*?)\s*$")  # a case id may hold spaces


def durations(lines) -> dict[str, float]:
    """Seconds per test node id, summed over its setup, call and teardown lines."""
    out: dict[str, float] = collections.defaultdict(float)
    for line in lines:
        m = LINE.match(line)
        if m and not m.group(2).startswith(OWN_LANES):
            out[m.group(2)] += float(m.group(1))
    return dict(out)


def lanes(seconds: dict[str, float], sweep: float, single: float, slow: float) -> dict[str, list[str]]:
    by_function: dict[str, list[tuple[float, str]]] = collections.defaultdict(list)
    for node, t in seconds.items():
        by_function[node.split("[")[0]].append((t, node))
    lane: dict[str, str] = {}
    for cases in by_function.values():
        cases.sort()
        total = sum(t for t, _ in cases)
        for i, (_, node) in enumerate(cases):
            if len(cases) > 1:
                lane[node] = "bench" if total > sweep and i > 0 else "test"
            else:
                lane[node] = "bench" if total > single else "test"
    lane.update({node: chosen for node, chosen in OVERRIDES.items() if node in lane or chosen == "bench"})
    return {"bench": sorted(node for node, chosen in lane.items() if chosen == "bench"),
            "slow": sorted(node for node, chosen in lane.items() if chosen == "test" and seconds.get(node, 0) > slow)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("durations", type=argparse.FileType(), nargs="+")
    parser.add_argument("--sweep", type=float, default=4.0)
    parser.add_argument("--single", type=float, default=8.0)
    parser.add_argument("--slow", type=float, default=0.5)
    args = parser.parse_args(argv)
    seconds = {}
    for file in args.durations:
        seconds.update(durations(file))
    chosen = lanes(seconds, args.sweep, args.single, args.slow)
    out = sys.stdout
    out.write("# Written by benchmarks/suite_lanes.py from a measured --durations=0 run (its docstring has the\n"
              f"# rule): --sweep {args.sweep:g} --single {args.single:g} --slow {args.slow:g}. One node id a line,\n"
              "# under the lane it moves to. tests/conftest.py adds the lane's marker.\n")
    for lane, nodes in chosen.items():
        out.write(f"[{lane}]\n")
        out.writelines(f"{node}\n" for node in nodes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
