"""bench/peer_bench.py's arithmetic and tables (pure functions: no venvs, no servers), and bench/live.py's
closed-loop client against a stub HTTP server; nothing here asserts a speed."""

import asyncio
import math
from pathlib import Path

import pytest

from bench import live, peer_bench
from bench.peer_bench import Measure, Summary


def test_percentile_is_nearest_rank_and_nan_when_empty():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert [peer_bench.percentile(values, q) for q in (0, 0.5, 0.99, 1)] == [1.0, 3.0, 5.0, 5.0]
    assert math.isnan(peer_bench.percentile([], 0.5))


def test_measure_counts_a_request_that_straddles_the_window_for_its_part_inside():
    spans = [
        (-0.5, 0.5, True),  # half inside
        (0.5, 1.5, True),  # whole
        (1.5, 2.5, False),  # half inside, and an error
        (-2.0, -1.0, True),  # warm-up only
        (2.0, 3.0, True),
    ]  # sent after the window
    m = peer_bench.measure(spans, seconds=2.0, texts_per_request=32)
    assert m == Measure(rps=1.0, texts_per_s=32.0, p50_ms=1000.0, p99_ms=1000.0, errors=1)


def test_summarize_takes_medians_over_rounds_and_adds_errors():
    rounds = [Measure(10, 320, 5, 9, 0), Measure(30, 960, 7, 20, 1), Measure(20, 640, 6, 10, 2)]
    assert peer_bench.summarize(rounds) == Summary(
        rps=20, rps_low=10, rps_high=30, texts_per_s=640, p50_ms=6, p99_ms=10, errors=3, rounds=3
    )


def summary(rps: float, p50: float) -> Summary:
    return Summary(rps, rps, rps, rps, p50, 2 * p50, 0, 1)


def test_tables_give_each_server_a_row_and_bertserve_over_each_peer():
    servers, cells = ["bertserve", "infinity", "plain"], ["short-1", "batch32-4"]
    summaries = {
        ("short-1", "bertserve"): summary(60, 16),
        ("short-1", "infinity"): summary(30, 32),
        ("short-1", "plain"): summary(20, 8),
        ("batch32-4", "bertserve"): summary(8, 600),
        ("batch32-4", "infinity"): summary(0, float("nan")),
        ("batch32-4", "plain"): summary(4, 300),
    }
    table = peer_bench.results_table(summaries, cells, servers).splitlines()
    assert table[0] == "| cell | server | req/s (min-max) | texts/s | p50 ms | p99 ms | errors |"
    assert table[2] == "| short-1: 1 text x 10 tok, 1 client | bertserve | 60.0 (60.0-60.0) | 60.0 | 16.0 | 32.0 | 0 |"
    assert len(table) == 2 + 6
    ratios = peer_bench.ratio_table(summaries, cells, servers).splitlines()
    assert ratios[0] == (
        "| cell | req/s bertserve/infinity | p50 bertserve/infinity | req/s bertserve/plain | p50 bertserve/plain |"
    )
    assert ratios[2:] == ["| short-1 | 2.00 | 0.50 | 3.00 | 2.00 |", "| batch32-4 | n/a | n/a | 2.00 | 2.00 |"]


def test_no_ratio_table_without_bertserve_or_a_peer():
    assert peer_bench.ratio_table({}, ["short-1"], ["infinity", "plain"]) is None
    assert peer_bench.ratio_table({}, ["short-1"], ["bertserve"]) is None


def test_cells_send_the_same_texts_in_the_same_order_to_every_server():
    texts = {"short": [f"s{i}" for i in range(64)], "long": [f"l{i}" for i in range(64)]}
    single = peer_bench.cell_bodies(peer_bench.CELLS["short-32"], texts)
    batched = peer_bench.cell_bodies(peer_bench.CELLS["batch32-1"], texts)
    assert single[0] == b'{"model": "minilm", "input": "s0"}' and len(single) == 64
    assert len(batched) == 2 and batched[1].startswith(b'{"model": "minilm", "input": ["s32", "s33", ')


def test_venvs_inside_the_repository_are_refused(tmp_path):
    with pytest.raises(ValueError, match="inside the repository"):
        peer_bench.ensure_venv(live.ROOT / "peers", "plain")


def test_unknown_servers_and_cells_are_refused(capsys):
    with pytest.raises(SystemExit):
        peer_bench.parse_args(["--servers", "bertserve,tei"])
    assert "--servers: unknown tei" in capsys.readouterr().err


def test_closed_loop_sends_each_clients_bodies_in_turn_and_counts_non_200():
    seen = []

    async def handle(reader, writer):
        try:
            while request := await reader.readuntil(b"\r\n\r\n"):
                length = int(request.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                body = await reader.readexactly(length)
                seen.append(body)
                status = b"500 Internal Server Error" if body == b"bad" else b"200 OK"
                writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: 2\r\n\r\n{}")
                await writer.drain()
        except asyncio.IncompleteReadError:  # the client closed its connection
            writer.close()

    async def run():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await live.closed_loop(
                port, "/v1/embeddings", [b"a", b"bad", b"c", b"d"], clients=2, seconds=0.2, warmup=0.05
            )

    spans = asyncio.run(run())
    assert spans and all(sent <= done for sent, done, _ in spans)
    assert sum(not ok for *_, ok in spans) == seen.count(b"bad") > 0
    assert set(seen) == {b"a", b"bad", b"c", b"d"}


def test_infinity_runs_at_its_best_cpu_setting_and_onnx_pools_as_minilm_does(monkeypatch):
    monkeypatch.setattr(peer_bench, "bf16_native", lambda kind: kind == "native")
    assert peer_bench.infinity_dtype("best", "native") == "bfloat16"
    assert peer_bench.infinity_dtype("best", "avx2") == "float32"
    assert peer_bench.infinity_dtype("float32", "native") == "float32"  # asked for: as asked

    def flags(name: str, dtype: str) -> dict[str, str]:
        command = peer_bench.peer_command(name, Path("/venv"), 8000, dtype)
        return dict(zip(command[2::2], command[3::2]))

    torch_engine = flags("infinity", "bfloat16")
    assert torch_engine["--engine"] == "torch" and torch_engine["--dtype"] == "bfloat16"
    assert torch_engine["--model-id"] == str(peer_bench.MINILM_DIR) and "--pooling-method" not in torch_engine
    onnx = flags("infinity-onnx", "bfloat16")
    assert onnx["--engine"] == "optimum" and onnx["--dtype"] == "float32"  # ONNX Runtime's model is fp32
    assert onnx["--pooling-method"] == "mean" and onnx["--model-id"] == "."  # run in the exported model's folder


def test_the_cpu_kind_lowers_what_torch_and_onednn_use_in_every_server():
    assert peer_bench.thread_env(2)["OMP_NUM_THREADS"] == "2" and "ATEN_CPU_CAPABILITY" not in peer_bench.thread_env(2)
    lowered = peer_bench.thread_env(2, "avx2")
    assert lowered["ATEN_CPU_CAPABILITY"] == "avx2" and lowered["ONEDNN_MAX_CPU_ISA"] == "AVX2"


def test_accuracy_is_the_lowest_cosine_to_the_fp32_reference():
    reference = [[1.0, 0.0], [0.0, 1.0]]
    assert peer_bench.min_cosine([[2.0, 0.0], [0.0, 3.0]], reference) == pytest.approx(1.0)  # length is no error
    assert peer_bench.min_cosine([[1.0, 0.0], [1.0, 1.0]], reference) == pytest.approx(0.5**0.5)


def test_by_default_ours_serves_at_auto_beside_infinity_and_the_plain_app():
    args = peer_bench.parse_args([])
    assert args.precision == "auto" and args.infinity_dtype == "best" and args.cpu_kind == "native"
    assert args.servers == "bertserve,infinity,plain"  # infinity-onnx when asked: its venv is a large one
    assert peer_bench.parse_args(["--servers", "bertserve,infinity-onnx"]).servers == "bertserve,infinity-onnx"
