"""`ds4` interactive mode under Ctrl+C, and the KV line of `--inspect` (real subprocesses, tiny GGUF)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from ds4.engine.model import Model


def test_ctrl_c_stops_the_generation_not_the_repl(tiny_gguf, tmp_path):
    cmd = [sys.executable, "-m", "ds4.engine.cli", "-m", str(tiny_gguf), "--nothink", "--temp", "0",
           "--ctx", "4096", "-n", "3000"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, HOME=str(tmp_path)))
    out = bytearray()
    started = threading.Event()

    def pump():
        while chunk := proc.stdout.read1(4096):
            out.extend(chunk)
            if len(out) > 20:
                started.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc.stdin.write("Tell me a very long story.\n".encode())
        proc.stdin.flush()
        assert started.wait(120), "no streamed output"
        proc.send_signal(signal.SIGINT)  # mid-generation: 3000 tokens take far longer than this
        time.sleep(0.5)
        proc.stdin.write("/nothink\n/quit\n".encode())
        proc.stdin.close()
        rc = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(5)
    err = proc.stderr.read().decode()
    assert rc == 0, err
    assert "Traceback" not in err
    assert err.count("prefill:") == 1  # the interrupted turn kept its tokens and reported its timing
    assert "generation:" in err


def test_inspect_reports_kv_bytes_per_token(tiny_gguf):
    from ds4.engine.session import kv_bytes_per_token

    r = subprocess.run([sys.executable, "-m", "ds4.engine.cli", "-m", str(tiny_gguf), "--inspect"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if "kv per token" in ln)
    cfg = Model.load(tiny_gguf).config
    assert f"{kv_bytes_per_token(cfg):.1f} bytes" in line
