"""What the tests of examples/python/train_llama.py share: the script's path,
the tiny model's flags, a small corpus written into a test's folder, and
run_script, which runs the script as its own process would run."""
import json
import os
import select
import signal
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "python", "train_llama.py")
DEFAULT_CONFIG = os.path.join(ROOT, "examples", "configs", "llama_default.json")


def tiny(eval_every=1):
    """The flags of a one-layer tiny Llama on 16-byte windows, quiet, no sample."""
    return ["--size", "tiny", "--layers", "1", "--seq-len", "16", "--eval-every", str(eval_every), "--eval-batches",
            "1", "--sample", "0", "--no-progress"]


def corpus(tmp_path):
    """A corpus folder under tmp_path (200 short lines, as the fortunes are split); its path."""
    d = tmp_path / "corpus"
    d.mkdir(exist_ok=True)
    (d / "text").write_text("\n%\n".join(f"The quick brown fox {i} jumps over the lazy dog." for i in range(200)))
    return str(d)


# The script's runs, forked from one Python that imported torch once. Starting
# a Python with torch costs about 1.5 s, most of a refused run's time: the
# zygote (a child of the test process that has imported torch and nothing of
# strata) forks once per run, and the fork runs the script as `python3 SCRIPT
# ARGS` would, in its own folder, with its own stdout and stderr, exit status
# and signals. The zygote holds no state of a run: each fork starts where the
# last began.
_ZYGOTE = r"""
import json, os, runpy, signal, sys, traceback
import torch  # noqa: F401  (the point of the zygote)

for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(req["cwd"])
            for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["stdout"], os.O_WRONLY),
                                    (2, req["stderr"], os.O_WRONLY)):
                f = os.open(path, flags)
                os.dup2(f, fd)
                os.close(f)
            sys.stdin = open(0, closefd=False)
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", closefd=False)
            sys.argv = req["argv"]
            sys.path[0] = os.path.dirname(os.path.abspath(req["argv"][0]))
            try:
                runpy.run_path(req["argv"][0], run_name="__main__")
                code = 0
            except SystemExit as e:  # as the interpreter reads sys.exit's argument
                if e.code is None:
                    code = 0
                elif isinstance(e.code, int):
                    code = e.code
                else:
                    print(e.code, file=sys.stderr)
                    code = 1
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code & 0xFF)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    print(json.dumps({"code": code}), flush=True)
"""
_zygote = None


def _reply(timeout):
    """The zygote's next line (JSON), or None after `timeout` seconds without one. Read a byte at a time
    from the pipe itself: a buffered reader could hold the next line where select() cannot see it."""
    line = b""
    while not line.endswith(b"\n"):
        if not select.select([_zygote.stdout], [], [], timeout)[0]:
            return None
        byte = os.read(_zygote.stdout.fileno(), 1)
        if not byte:
            raise RuntimeError(f"the zygote ended (exit {_zygote.wait()})")
        line += byte
    return json.loads(line)


def run_script(args, cwd, timeout=300):
    """`python3 SCRIPT *args` in cwd, as subprocess.run(..., capture_output=True, text=True) returns it."""
    global _zygote
    if _zygote is None or _zygote.poll() is not None:
        _zygote = subprocess.Popen([sys.executable, "-c", _ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   bufsize=0)
    argv = [SCRIPT, *map(str, args)]
    with tempfile.TemporaryDirectory() as d:
        out, err = os.path.join(d, "stdout"), os.path.join(d, "stderr")
        for path in (out, err):
            open(path, "w").close()
        _zygote.stdin.write((json.dumps({"argv": argv, "cwd": str(cwd), "stdout": out, "stderr": err}) +
                             "\n").encode())
        pid = _reply(60)["pid"]
        done = _reply(timeout)
        if done is None:
            os.kill(pid, signal.SIGKILL)
            _reply(60)
            raise subprocess.TimeoutExpired(argv, timeout)
        with open(out) as f_out, open(err) as f_err:
            return subprocess.CompletedProcess([sys.executable, *argv], done["code"], f_out.read(), f_err.read())
