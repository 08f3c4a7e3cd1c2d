"""Show the progress of a verbose pip build and keep its whole output in a log file.

    python3 -m pip install -v ... 2>&1 | python3 .ci/build_log.py LOG

Prints one line per compiled file (C: setuptools' compile commands; C++ and CUDA: ninja's
"[k/n]" steps) with the elapsed time, the build's own "dsv-ext:" lines, compiler
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
collecting = False
with open(LOG, "w") as log:
    for line in sys.stdin:
        log.write(line)
        log.flush()
        text = line.strip()  # pip -v indents the build's output
        m = COMPILE.search(text)
        if m:
            n = NINJA.match(text)  # ninja prints a step when it ends (output not a terminal)
            say(f"[{n.group(1)}/{n.group(2)}] compiled {short(m.group(1))}" if n
                else f"compiling {short(m.group(1))}")
        elif text.startswith("dsv-ext: "):
            say(text[len("dsv-ext: "):])
        elif text.startswith("Collecting ") and not collecting:
            collecting = True
            say("resolving the requirements")
        elif text.startswith("Installing collected packages:"):
            say(text)
        elif DIAG.search(text) and "is ignored: it is neither a file nor a directory" not in text:
            say(text)
