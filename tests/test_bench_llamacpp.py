"""`bench throughput --against llamacpp`: the driver of llama.cpp's server, against a test double of llama-server
(a small HTTP server of ours that speaks its /health and /completion JSON, started as the build's bin/llama-server,
with a llama-quantize that copies), the tables' llama.cpp columns, and a missing build failing at once."""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from tokenmill.bench import llamacpp_compare as lc
from tokenmill.bench.throughput import Result
from tokenmill.bench.workload import Workload
from tokenmill.cli import main

ROOT = Path(__file__).resolve().parent.parent

# llama-server's double: --port and friends as llama-server takes them; /health answers 503 (loading) once, then
# 200; /completion answers n_predict ids (prompt[-1] + 1, + 2, ...) after a short sleep, so requests sent at once
# overlap. FAKE_LLAMA_RECORD gets its argv and pid, then one line per request with the most requests in flight;
# FAKE_LLAMA_MODE=short generates one token too few, crash exits before listening.
FAKE_SERVER = textwrap.dedent('''
    import json, os, sys, threading, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    args = sys.argv[1:]
    record = open(os.environ["FAKE_LLAMA_RECORD"], "a")
    record.write(json.dumps({"argv": args, "pid": os.getpid()}) + "\\n")
    record.flush()
    if os.environ.get("FAKE_LLAMA_MODE") == "crash":
        print("error: failed to load model", flush=True)
        sys.exit(1)
    lock, state = threading.Lock(), {"health": 0, "in_flight": 0}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def answer(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            state["health"] += 1
            if state["health"] == 1:
                self.answer(503, {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}})
            else:
                self.answer(200, {"status": "ok"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                state["in_flight"] += 1
                in_flight = state["in_flight"]
            time.sleep(0.2)
            with lock:
                state["in_flight"] -= 1
                record.write(json.dumps({"path": self.path, "body": body, "in_flight": in_flight}) + "\\n")
                record.flush()
            n = body["n_predict"] - (os.environ.get("FAKE_LLAMA_MODE") == "short")
            self.answer(200, {"content": "", "tokens": [body["prompt"][-1] + i + 1 for i in range(n)],
                              "tokens_predicted": n, "tokens_evaluated": len(body["prompt"]), "truncated": False,
                              "stop_type": "limit"})

    ThreadingHTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Handler).serve_forever()
''')

FAKE_QUANTIZE = textwrap.dedent('''
    import shutil, sys
    args = sys.argv[1:]
    assert args[0] == "--allow-requantize", args
    shutil.copyfile(args[1], args[2])
    open(args[2], "a").write(args[3])
''')


def fake_build(tmp_path: Path, monkeypatch, mode: str = "") -> tuple[Path, Path, Path]:
    """(bin/llama-server of a fake build, the GGUF to serve, the double's record)."""
    bin_dir = tmp_path / "llamacpp" / "bin"
    bin_dir.mkdir(parents=True)
    for name, source in (("llama-server", FAKE_SERVER), ("llama-quantize", FAKE_QUANTIZE)):
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{source}")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    gguf = tmp_path / "Model.Q4_1.gguf"
    gguf.write_text("GGUF")
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_RECORD", str(record))
    monkeypatch.setenv("FAKE_LLAMA_MODE", mode)
    return bin_dir / "llama-server", gguf, record


def read_record(record: Path) -> tuple[dict, list[dict]]:
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    return lines[0], lines[1:]


def test_the_workload_goes_to_llama_server_at_once_with_its_forced_lengths(tmp_path, monkeypatch):
    binary, gguf, record = fake_build(tmp_path, monkeypatch)
    workload = Workload(prompts=[[1, 2, 3], [40, 50], [7]], output_lens=[3, 5, 2])
    run = lc.run_llamacpp(binary, gguf, workload, "float32", threads=2,
                          batch1=([1, 2, 3], 4))
    assert run.result.system == "llama.cpp" and run.result.dtype == "float32"
    assert run.result.useful_tokens == 10 and run.result.seconds >= 0.2
    assert run.output_token_ids == [[4, 5, 6], [51, 52, 53, 54, 55], [8, 9]]
    assert run.batch1_tpot is not None and run.batch1_tpot < 1
    assert "requantized to F32" in run.result.note and "f32 KV" in run.result.note
    start, requests = read_record(record)
    argv = start["argv"]
    option = lambda name: argv[argv.index(name) + 1]
    # the requantized copy sits beside the build, made once with --allow-requantize
    served = tmp_path / "llamacpp" / "models" / "Model.Q4_1.F32.gguf"
    assert option("--model") == str(served) and served.read_text() == "GGUFF32"
    assert option("--parallel") == "3" and "--cont-batching" in argv and "--no-kv-unified" in argv
    assert option("--ctx-size") == str(3 * 256) and option("--threads") == option("--threads-batch") == "2"
    assert option("--cache-type-k") == option("--cache-type-v") == "f32" and option("--host") == "127.0.0.1"
    with pytest.raises(ProcessLookupError):  # the server is gone with the run
        os.kill(start["pid"], 0)
    assert {r["path"] for r in requests} == {"/completion"}
    bodies = [r["body"] for r in requests]
    for body in bodies:
        assert body["ignore_eos"] is True and body["cache_prompt"] is False and body["temperature"] == 0
        assert body["return_tokens"] is True and body["stream"] is False
    # a two-request warm-up of 2 tokens, the workload, then batch 1: (1 token, 4 tokens) x 3
    assert sorted((tuple(b["prompt"]), b["n_predict"]) for b in bodies[:2]) == [((1, 2, 3), 2), ((40, 50), 2)]
    workload_requests = requests[2:5]
    assert sorted((tuple(r["body"]["prompt"]), r["body"]["n_predict"]) for r in workload_requests) == \
        [((1, 2, 3), 3), ((7,), 2), ((40, 50), 5)]
    assert max(r["in_flight"] for r in workload_requests) == 3  # all at once
    assert [b["n_predict"] for b in bodies[5:]] == [1, 4] * 3


def test_the_shipped_file_is_served_as_it_is_with_llamacpps_f16_kv_cache(tmp_path, monkeypatch):
    binary, gguf, record = fake_build(tmp_path, monkeypatch)
    run = lc.run_llamacpp(binary, gguf, Workload(prompts=[[5] * 300], output_lens=[4]), lc.SHIPPED, threads=1)
    assert run.result.system == "llama.cpp, Q4_1 as shipped" and run.result.dtype == "Q4_1"
    assert run.batch1_tpot is None and run.output_token_ids == [[6, 7, 8, 9]]
    argv = read_record(record)[0]["argv"]
    assert argv[argv.index("--model") + 1] == str(gguf) and not (tmp_path / "llamacpp" / "models").exists()
    assert argv[argv.index("--cache-type-k") + 1] == "f16"
    assert argv[argv.index("--ctx-size") + 1] == "512"  # 304 tokens, rounded up to 256s


def test_a_reply_short_of_the_forced_length_fails_the_run(tmp_path, monkeypatch):
    binary, gguf, _ = fake_build(tmp_path, monkeypatch, mode="short")
    with pytest.raises(RuntimeError, match="llama.cpp generated 1 tokens .*expected 2"):
        lc.run_llamacpp(binary, gguf, Workload(prompts=[[1, 2]], output_lens=[3]), lc.SHIPPED, threads=1)


def test_a_server_that_exits_before_it_is_ready_says_why(tmp_path, monkeypatch):
    binary, gguf, _ = fake_build(tmp_path, monkeypatch, mode="crash")
    with pytest.raises(RuntimeError, match="(?s)exited \\(1\\) before it was ready.*failed to load model"):
        lc.run_llamacpp(binary, gguf, Workload(prompts=[[1, 2]], output_lens=[3]), lc.SHIPPED, threads=1)


@pytest.mark.parametrize("reply, message", [
    ({"tokens": [1, 2], "tokens_predicted": 2, "tokens_evaluated": 3}, "generated 2 tokens"),
    ({"tokens": [], "tokens_predicted": 3, "tokens_evaluated": 3}, r"\(0 ids returned\)"),
    ({"tokens": [1, 2, 3], "tokens_predicted": 3, "tokens_evaluated": 4}, "evaluated 4 prompt tokens of 3"),
    ({"tokens": [1, 2, 3], "tokens_predicted": 3, "tokens_evaluated": 3, "truncated": True}, "truncated: True"),
])
def test_replies_are_checked_against_the_request(reply, message):
    with pytest.raises(RuntimeError, match=message):
        lc.checked_tokens(reply, [7, 8, 9], 3)
    assert lc.checked_tokens({"tokens": [1, 2, 3], "tokens_predicted": 3, "tokens_evaluated": 3,
                              "truncated": False}, [7, 8, 9], 3) == [1, 2, 3]


def test_a_missing_build_fails_at_once_with_the_command_that_builds_it(tmp_path, capsys):
    code = main(["bench", "throughput", "--against", "llamacpp,vllm", "--llamacpp-dir", str(tmp_path / "none"),
                 "--no-plots"])
    err = capsys.readouterr().err
    assert code == 2
    assert "llama.cpp's server is not built in" in err and "`make llamacpp`" in err
    assert f"ops/llamacpp_build.sh {tmp_path / 'none'}" in err.replace("\n", "")


def test_against_names_only_the_engines_a_benchmark_offers(tmp_path, monkeypatch):
    from tokenmill.bench.throughput_cli import against_llamacpp, against_systems

    throughput = argparse.Namespace(against="llamacpp, vllm", against_choices=("llamacpp", "vllm"))
    assert against_systems(throughput) == {"llamacpp", "vllm"}
    with pytest.raises(ValueError, match="unknown --against system.*choose from vllm$"):
        against_systems(argparse.Namespace(against="llamacpp", against_choices=("vllm",)))
    monkeypatch.setenv("TOKENMILL_LLAMACPP_DIR", str(tmp_path / "env-dir"))
    assert lc.default_dir() == tmp_path / "env-dir"
    with pytest.raises(FileNotFoundError, match="not built in .*env-dir: run `make llamacpp`"):
        against_llamacpp(argparse.Namespace(against="llamacpp", against_choices=("llamacpp",), llamacpp_dir=None,
                                            model="smollm2-135m"))
    assert against_llamacpp(argparse.Namespace(against="vllm", against_choices=("llamacpp", "vllm"))) is None


def test_the_build_script_builds_the_version_the_benchmark_looks_for():
    script = (ROOT / "ops" / "llamacpp_build.sh").read_text()
    assert re.search(r'VERSION="\$\{LLAMACPP_VERSION:-([\d.]+)\}"', script).group(1) == lc.LLAMACPP_VERSION
    assert "llamacpp:\n\t./ops/llamacpp_build.sh" in (ROOT / "Makefile").read_text()


def test_the_tables_put_llamacpp_beside_vllm():
    from rich.console import Console

    from tokenmill.bench.tables import batch1_table, throughput_table

    results = [Result("tokenmill", "float32", 10.0, 4000), Result("vLLM", "float32", 20.0, 4000),
               Result("llama.cpp", "float32", 16.0, 4000), Result("llama.cpp, Q4_1 as shipped", "Q4_1", 8.0, 4000)]
    console = Console(width=250, record=True)
    console.print(throughput_table(results))
    console.print(batch1_table([("tokenmill", "float32", 0.02), ("vLLM", "float32", 0.04),
                                ("llama.cpp", "float32", 0.03), ("llama.cpp, Q4_1 as shipped", "Q4_1", 0.01)], 128))
    text = console.export_text()
    assert text.count("x llama.cpp") == 2
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in text.splitlines() if "│ tokenmill" in line]
    assert rows[0][4:6] == ["2.00x", "1.60x"]  # throughput: x vLLM, x llama.cpp
    assert rows[1][3:5] == ["2.00x", "1.50x"]  # batch 1
    q4 = next(line for line in text.splitlines() if "Q4_1 as shipped" in line and "500.0" in line)
    assert q4.count("-") >= 2  # no dtype to compare it with
    plain = Console(width=250, record=True)
    plain.print(throughput_table(results[:2]))
    assert "x llama.cpp" not in plain.export_text()  # without llama.cpp, the table is as it was
