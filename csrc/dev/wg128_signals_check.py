"""A model check of the signals between the two warpgroups of the 128-row backward under kernel
tuning g128 = 2 (bwd_wg128_kernel with PP, csrc/cuda/sparse_attention_bwd_wg.cuh; PERF_LOG v28).

Each warpgroup is one agent running, in order, the signal and shared-memory steps of its code
(one list per warpgroup below, transcribed from the kernel: keep them in step with it). Random
interleavings of the two agents and of the key-tile copies in flight are run for 0-8 tiles,
with vector clocks for what each signal orders. It fails on a deadlock, on a named barrier
arrived at twice before its sync, on an arrival left without a sync at the end, on a read that
does not follow the write of the tile it wants, and on a write that does not follow every read
of the data it replaces.   usage: python3 csrc/dev/wg128_signals_check.py
"""
import random
import sys

NS = 2  # key stages


def steps(wg, nt):
    """Warpgroup wg's steps over nt key tiles."""
    o = []
    if wg == 1 and nt > 0:
        o.append(("issue", 0))
    o.append(("cta",))  # the prologue's __syncthreads: Q, dO and key tile 0 landed
    for t in range(nt):
        st = t % NS
        if wg == 1 and t > 0:  # dQ (t - 1) and dK_t of tile t - 1
            o += [("sync", "PD0", (t - 1) & 1), ("read", "stage", st ^ 1, t - 1),
                  ("read", "dS", (t - 1) & 1, 0, t - 1), ("read", "dS", (t - 1) & 1, 1, t - 1)]
            if t + 1 < nt:
                o.append(("arrive", "DK", (t - 1) & 1))
        if wg == 1 and t + 1 < nt:  # gather tile t + 1 into the stage of tile t - 1
            if t > 0:
                o.append(("sync", "EMPTY", (t + 1) % NS))
            o.append(("issue", t + 1))
        o += [("wait", st, (t // NS) & 1), ("read", "stage", st, t), ("read", "kidx", st, t)]
        if t >= 2:
            o.append(("sync", "DV" if wg else "DK", t & 1))
        o += [("write", "P", t & 1, wg, t), ("write", "dS", t & 1, wg, t),
              ("arrive", "PD1" if wg else "PD0", t & 1)]
        if wg == 0:  # dQ (t), then dV_t of tile t - 1
            o.append(("read", "stage", st, t))
            if t > 0:
                o += [("sync", "PD1", (t - 1) & 1), ("read", "P", (t - 1) & 1, 0, t - 1),
                      ("read", "P", (t - 1) & 1, 1, t - 1)]
                if t + 1 < nt:
                    o.append(("arrive", "DV", (t - 1) & 1))
        o.append(("read", "kidx", st, t))  # bwg_reduce_key
        if wg == 0 and t + 2 < nt:
            o.append(("arrive", "EMPTY", st))
    if nt > 0:  # the last tile's products
        t = nt - 1
        o.append(("sync", "PD0" if wg else "PD1", t & 1))
        if wg == 1:
            o.append(("read", "stage", t % NS, t))
        n = "dS" if wg else "P"
        o += [("read", n, t & 1, 0, t), ("read", n, t & 1, 1, t)]
    return o


def before(a, b):
    return all(x <= y for x, y in zip(a, b))


def join(a, b):
    return [max(x, y) for x, y in zip(a, b)]


def run(nt, seed):
    rnd = random.Random(seed)
    prog = [steps(0, nt), steps(1, nt)]
    pc, vc = [0, 0], [[0, 0], [0, 0]]
    bars = {}                                   # (name, parity) -> [(agent, clock)] arrived
    mbar = {s: [0, {}] for s in range(NS)}      # completed phases, clock of each completion
    flight = []                                 # copies in flight: (stage, tile, clock)
    data = {}                                   # ("stage", s) ... -> (tile, write clock, reads)
    at_cta = set()
    while pc[0] < len(prog[0]) or pc[1] < len(prog[1]) or flight:
        moves = [("agent", a) for a in (0, 1) if pc[a] < len(prog[a])]
        moves += [("land", i) for i in range(len(flight))]
        rnd.shuffle(moves)
        for kind, x in moves:
            if kind == "land":
                s, t, v = flight.pop(x)
                for r in (data.get(("stage", s)) or (0, 0, []))[2]:
                    if not before(r, v):
                        return f"tile {t} copied over stage {s} before its reads"
                data[("stage", s)] = (t, v, [])
                data[("kidx", s)] = (t, v, [])
                mbar[s][0] += 1
                mbar[s][1][mbar[s][0]] = v
                break
            a = x
            op = prog[a][pc[a]]
            if op[0] == "cta":
                at_cta.add(a)
                if len(at_cta) < 2 or flight:
                    continue
                vc[0] = vc[1] = join(vc[0], vc[1])
                vc = [list(vc[0]), list(vc[1])]
                pc[0] += 1
                pc[1] += 1
                at_cta.clear()
                break
            if op[0] == "arrive":
                g = bars.setdefault(op[1:], [])
                if g:
                    return f"{op[1:]} arrived at twice before its sync"
                vc[a][a] += 1
                g.append((a, list(vc[a])))
            elif op[0] == "sync":
                g = bars.get(op[1:], [])
                if not g:
                    continue
                vc[a] = join(vc[a], g[0][1])
                bars[op[1:]] = []
            elif op[0] == "issue":
                vc[a][a] += 1
                flight.append((op[1] % NS, op[1], list(vc[a])))
            elif op[0] == "wait":
                s, parity = op[1], op[2]
                if (mbar[s][0] & 1) == parity:  # that phase not completed yet
                    continue
                vc[a] = join(vc[a], mbar[s][1][mbar[s][0]])
            elif op[0] == "read":
                key, t = (op[1],) + op[2:-1], op[-1]
                cur = data.get(key)
                if not cur or cur[0] != t:
                    return f"warpgroup {a} reads {key} of tile {t}, finds tile {cur and cur[0]}"
                if not before(cur[1], vc[a]):
                    return f"warpgroup {a} reads {key} of tile {t} unordered after its write"
                vc[a][a] += 1
                cur[2].append(list(vc[a]))
            elif op[0] == "write":
                key, t = (op[1],) + op[2:-1], op[-1]
                vc[a][a] += 1
                for r in (data.get(key) or (0, 0, []))[2]:
                    if not before(r, vc[a]):
                        return f"warpgroup {a} writes {key} of tile {t} before its last reads"
                data[key] = (t, list(vc[a]), [])
            pc[a] += 1
            break
        else:
            return f"deadlock at {[prog[i][pc[i]] if pc[i] < len(prog[i]) else 'end' for i in (0, 1)]}"
    left = {k: v for k, v in bars.items() if v}
    return f"arrivals left without a sync: {sorted(left)}" if left else None


def main():
    for nt in range(9):
        for seed in range(300):
            err = run(nt, seed)
            if err:
                print(f"{nt} tiles, interleaving {seed}: {err}")
                return 1
    print("ok: 0-8 tiles, 300 interleavings each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
