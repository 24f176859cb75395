"""How the report writes what a run recorded: significant digits, short config and kernel labels, the columns a
table keeps, the environment's rows, the overview's sentence and colours, the charts' choices."""

import gzip
import json

import pytest

from reports import charts, formatting
from reports.formatting import number, sig3
from reports.overview import heat, sentence
from reports.runs import Run, load_run
from tests.test_report import ROOT

GPU_RUN = ROOT / "docs" / "results" / "prefill-blog-fa3-h200.json.gz"


@pytest.mark.parametrize(("value", "trimmed", "kept"), [
    (2.72e-4, "2.72e-4", "2.72e-4"), (0.000272, "2.72e-4", "2.72e-4"), (2.7e-4, "2.7e-4", "2.70e-4"),
    (1e-7, "1e-7", "1.00e-7"), (0.0241, "0.0241", "0.0241"), (0.00366, "0.00366", "0.00366"),
    (0.05, "0.05", "0.0500"), (1.0, "1", "1.00"), (12.34, "12.3", "12.3"), (99.96, "100", "100"),
    (360.6, "361", "361"), (1433.2, "1433", "1433"), (-0.0123, "-0.0123", "-0.0123"), (0, "0", "0"),
])
def test_figures_keep_three_significant_digits(value, trimmed, kept):
    assert sig3(value) == trimmed and sig3(value, zeros=True) == kept
    assert number(value) == kept


def test_a_missing_figure_is_a_dash_and_a_format_of_its_own_is_kept():
    assert sig3(None) == number(None) == "–"
    assert number(0.0123, "%+.1f") == "+0.0" and number(1605.4, "%.0f") == "1605"


def test_a_column_no_row_fills_is_left_out():
    rows = [{"tflops": 1.0, "pct": None, "config": "", "kernels": "fmha_fwd (100%)", "rows": []},
            {"tflops": None, "pct": None, "config": "", "kernels": "", "rows": {}}]
    keys = ["tflops", "pct", "config", "kernels", "rows", "absent"]
    assert formatting.filled_columns(rows, keys) == ["tflops", "kernels"]
    assert formatting.filled_columns([], ["tflops"]) == []
    assert formatting.filled_columns([{"speedup": 0.0}], ["speedup"]) == ["speedup"]  # zero is a value


CUTILE = {"tile_m": 128, "tile_n": 256, "occupancy": 1, "num_worker_warps": 8, "k_latency": 3, "v_latency": 6,
          "persistent": True, "tileiras": "tileiras 13.5.37", "chosen": "tuning cache", "tuner": "settled",
          "finalists": [{"variant": "b", "search_us": 941.2, "settled_us": 1056.1},
                        {"variant": "a", "search_us": 913.8, "settled_us": 1025.0}]}


@pytest.mark.parametrize(("config", "label"), [
    (CUTILE, "128×256 · L3,6 · 8 warps · persistent · tuned here"),
    ({"tile_m": 64, "tile_n": 64, "occupancy": 2, "k_latency": 2, "v_latency": 4},
     "64×64 · L2,4 · occupancy 2 · fixed"),
    ({"tile_n": 64, "read": "pages", "k_latency": 3, "v_latency": 3, "occupancy": 2, "num_splits": 8,
      "split_len": 64, "chosen": "autotuned"}, "tile 64 · L3,3 · occupancy 2 · split 8×64 · tuned here"),
    ({"route": "split-KV decode over the cache as pages of 256", "BLOCK_N": 32, "BLOCK_M": 16, "num_stages": 2,
      "num_warps": 4, "num_splits": 16, "split_len": 64, "chosen": "fixed (GPU shared: not tuned)"},
     "16×32 · 2 stages · 4 warps · split 16×64 · via split-KV decode · heuristic"),
    ({"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1, "USE_TMA": False, "chosen": "fixed (interpreter)"},
     "64×64 · 1 stage · 4 warps · fixed"),
    ({"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "chosen": "shipped (NVIDIA H200)"},
     "128×64 · 3 stages · 8 warps · shipped"),
    ({"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3,
      "chosen": "heuristic: nearest shipped class (NVIDIA H200)"}, "128×64 · 3 stages · 8 warps · heuristic"),
    ({"num_splits": 1, "pack_gqa": True, "why": "SplitKV not supported on SM 9.0"}, "no split"),
    ({"compiled": False, "block_size": [128, 128], "full_blocks": True}, "block 128×128 · not compiled"),
    ({"layout": "NHD"}, "layout=NHD"),
    ({}, ""),
])
def test_a_config_reads_as_a_short_label(config, label):
    assert formatting.config_label(config) == label


def test_the_whole_config_and_the_finalists_fastest_first_are_kept_for_the_folded_part():
    details = formatting.config_details(CUTILE)
    assert ("chosen", "tuning cache") in details["pairs"] and all(key != "finalists" for key, _ in details["pairs"])
    assert [f["variant"] for f in details["finalists"]] == ["a", "b"]
    assert formatting.config_details({"finalists": "not a list"})["pairs"] == [("finalists", "not a list")]


def test_kernel_names_lose_their_generated_parts():
    kernel_name = formatting.kernel_name
    assert kernel_name("fmha_fwd_Kt2_A4f16_7v8l0_8t1_ei16_p16_A4f16") == "fmha_fwd"
    assert kernel_name("kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at__t"
                       "ensor0000o11101213_0") == "FlashAttentionForwardSm90"
    assert kernel_name("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_"
                       "cga1x1x1_kernel0_0") == "cudnn_sdpa_sm90_flash_fprop_wgmma_f16"
    assert kernel_name("void at::native::elementwise_kernel<128, 4>(int, F)") == "at::native::elementwise_kernel"
    assert kernel_name("x" * 80) == "x" * 39 + "…"
    kernels = {"void a::small<int>(int)": {"launches": 1, "seconds": 1e-6},
               "b_big": {"launches": 2.0, "seconds": 3e-6}}
    assert formatting.kernel_label(kernels) == "b_big (75%) + 1 more" and formatting.kernel_label({}) == ""


def test_the_environment_names_the_host_cpu_and_leaves_out_what_no_run_recorded():
    gpu = load_run(GPU_RUN)
    rows = dict((label, cells[0]) for label, cells in formatting.env_rows([gpu]))
    assert rows["GPU"] == "NVIDIA H200" and rows["host CPU"] == "Intel(R) Xeon(R) Processor, 16 cores"
    assert rows["peak TFLOPS"] == "989.4 (sm_90 dense 16-bit peak of H100/H200 SXM)" and "cpu" not in rows
    assert "–" not in rows.values() and "n/a" not in rows.values() and gpu.machine == "NVIDIA H200"
    data = json.loads(gzip.decompress(GPU_RUN.read_bytes()))
    cpu = Run(label="", path="cpu.json", env={"device": "cpu", "torch": "2.13.0+cpu", "cuda_runtime": None,
                                             "peak_tflops": None, "peak_source": "no peak for CPU", "cpu": "x86_64"},
              measurements=[], outcomes=[], unavailable={}, presets={}, cases={}, host=data["machine_info"])
    assert cpu.on_cpu and cpu.machine == "CPU: Intel(R) Xeon(R) Processor"
    rows = dict(formatting.env_rows([cpu]))
    assert "GPU" not in rows and "CUDA runtime" not in rows and rows["peak TFLOPS"] == ["none (no peak for CPU)"]
    both = dict(formatting.env_rows([gpu, cpu]))
    assert both["GPU"] == ["NVIDIA H200", "n/a"] and both["host CPU"][1] == "Intel(R) Xeon(R) Processor, 16 cores"


def test_the_sentence_names_the_leader_and_our_kernels_against_it():
    values = {"c1": {"fa": 10.0, "cutile": 9.0, "triton": 5.0}, "c2": {"fa": 10.0, "cutile": 11.0}}
    rows = [{"impl": "fa", "wins": 1, "measured": 2, "ours": False}, {"impl": "cutile", "ours": True},
            {"impl": "triton", "ours": True}]
    text = sentence("p", "TFLOPS", rows, values)
    assert text == ("p (TFLOPS): fa leads, the best on 1 of 2 cases; against it, on the cases both ran: "
                    f"cutile {sig3((0.9 * 1.1) ** 0.5, zeros=True)}×, triton 0.500×.")
    ours_first = [{"impl": "cutile", "wins": 1, "measured": 2, "ours": True}, {"impl": "fa", "ours": False},
                  {"impl": "triton", "ours": True}]
    assert "on the cases both ran: fa (best peer) " in sentence("p", "TFLOPS", ours_first, values)
    alone = [{"impl": "fa", "wins": 2, "measured": 1, "ours": False}]
    assert sentence("p", "GB/s", alone, values) == ("p (GB/s): fa leads, the best on 2 of 2 cases (it ran 1); none "
                                                    "of our kernels (cutile*, triton*) was measured.")


def test_heat_runs_from_green_at_the_best_to_red_at_half_of_it():
    assert heat(1.0).startswith("hsl(120,") and heat(0.75).startswith("hsl(60,")
    assert heat(0.5).startswith("hsl(0,") and heat(0.01) == "hsl(0, 70%, 74%)"


def test_charts_choose_a_log_axis_past_thirty_times_and_merge_the_same_line():
    assert charts.spans_orders([1.0, 31.0]) and not charts.spans_orders([1.0, 30.0, 0.0, None])
    merged = charts.merged({"b": [(1, 2.0001)], "a": [(1, 2.0)], "c": [(1, 3.0)]})  # the same to 3 digits
    assert merged == [(["a", "b"], [(1, 2.0)]), (["c"], [(1, 3.0)])]
    style = charts.styles(["x", "y"], ["run1", "run2"])
    assert style("x") != style("y") and style("x @ run2").line != style("x @ run1").line
    assert style("x @ run2").colour == style("x").colour


def test_the_leader_is_faster_than_each_other_on_the_cases_both_ran():
    """Not the first by rate over each case's best alone: one that ran a single case, or one a rival beats on
    the cases they share, does not lead."""
    from reports.overview import leader

    values = {"c1": {"p": 20.0, "a": 10.0, "b": 9.0}, "c2": {"a": 10.0, "b": 11.0}, "c3": {"a": 10.0, "b": 9.0}}
    rows = [{"impl": "p", "measured": 1}, {"impl": "b", "measured": 3}, {"impl": "a", "measured": 3}]
    assert leader(rows, values)["impl"] == "a"
    tied = {"c1": {"a": 10.0, "b": 11.0}, "c2": {"a": 11.0, "b": 10.0}, "c3": {"a": 10.0, "b": 10.0}}
    assert leader(rows[1:], tied)["impl"] == "b"  # neither faster: the first row
