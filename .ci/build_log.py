"""Show the progress of a verbose pip build and keep its whole output in a log file.

    python3 -m pip install -v ... 2>&1 | python3 .ci/build_log.py LOG

Prints one line per compiled file (C, C++, CUDA: the compile commands of setuptools and of
ninja's "[k/n]" steps) with the elapsed time, the build's own "dsv-ext:" lines, compiler
diagnostics, and "still building" every 60 s of silence; everything goes to LOG. On a failed
build the caller prints the log's tail.
"""
import re
import sys
import threading
import time

LOG = sys.argv[1]
T0 = time.time()
COMPILE = re.compile(r"\s-c\s+(\S+\.(?:c|cc|cpp|cu))(?:\s|$)")
NINJA = re.compile(r"^\[(\d+)/(\d+)\]")
DIAG = re.compile(r"(?:^|\s)(?:warning|error)(?:\s*#\d+-D)?:", re.IGNORECASE)
last = [time.time()]
lock = threading.Lock()


def say(msg: str) -> None:
    with lock:
        print(f"[install] {time.time() - T0:4.0f} s  {msg}", flush=True)
        last[0] = time.time()


def ticker() -> None:
    while True:
        time.sleep(5)
        if time.time() - last[0] >= 60:
            say("still building ...")


def short(path: str) -> str:
    i = path.find("csrc/")
    return path[i:] if i >= 0 else path


threading.Thread(target=ticker, daemon=True).start()
with open(LOG, "w") as log:
    for line in sys.stdin:
        log.write(line)
        log.flush()
        text = line.rstrip("\n")
        m = COMPILE.search(text)
        if m:
            n = NINJA.match(text)
            say((f"[{n.group(1)}/{n.group(2)}] " if n else "") + "compiling " + short(m.group(1)))
        elif text.startswith("dsv-ext: "):
            say(text[len("dsv-ext: "):])
        elif DIAG.search(text) and "is ignored: it is neither a file nor a directory" not in text:
            say(text.strip())
