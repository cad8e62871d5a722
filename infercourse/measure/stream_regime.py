"""Which limit bound one phase of one stream: memory, its kernel's arithmetic, or neither.

A ceiling is a bound, not a label. A decode (or prefill) rate is read against two roofs, each on
the thread count the engine ran: **MBU**, the bytes a token reads at the measured pace ÷ the
bandwidth probed with an array several times the last-level cache (`measure.machine_probe`);
and the FLOP/s it did ÷ a compute roof *of its own kernel's data type*: a float32 matmul for a
float32 model, but for llama.cpp's quantized int8 dot products no probe measures the roof, so
it is read from llama.cpp itself (a long prompt's prefill, `roofline.achieved_gflops`), or left
out, and then the label says so. A **thread check** (`thread_check`: n and 2n threads with an
A/A rerun at n) adds a third reading: a phase that gains more from a second thread than the
bandwidth that thread adds was not held by memory.

`phase_regime`'s labels, at `regime.NEAR_ROOF` (half a roof), never from arithmetic intensity:

- **bandwidth-bound**: at least half the bandwidth roof, and the thread check agrees;
- **compute-bound**: at least half the compute roof;
- **neither: kernel/overhead-bound**: below both. Memory idles much of each step and the cores
  are not at their kernel's pace: the kernel's own latency (loads in flight, unpacking blocks)
  and per-step overhead (synchronization, sampling, the loop around the model) set it. One CPU
  thread running llama.cpp's quantized decode typically lands here; a GPU at batch 1 is
  bandwidth-bound; prefill is compute-bound.
- **not bandwidth-bound**: below half the bandwidth roof, with no compute roof to split the rest;
- **too close to call**: the rate's A/A band lets a share sit on either side of half a roof;
- **not judged**: the rate sits above the bandwidth roof (that roof is wrong: a cache, a probe
  that under-read).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from infercourse.measure import noise
from infercourse.measure.claims import verdict_sentence
from infercourse.measure.regime import NEAR_ROOF, _side, _tok

__all__ = ["NEITHER", "ThreadCheck", "thread_check", "PhaseRegime", "phase_regime"]


def _pct(x: float) -> str:
    """A share in %, with a decimal where rounding would cross `NEAR_ROOF` ("49.6%", never "50%" below it)."""
    return f"{x:.1%}" if (round(x, 2) >= NEAR_ROOF) != (x >= NEAR_ROOF) else f"{x:.0%}"


NEITHER = "neither: kernel/overhead-bound"


@dataclass(frozen=True)
class ThreadCheck:
    """One phase's rate at n and 2n threads, interleaved with an A/A rerun at n."""
    threads: tuple[int, int]
    comparison: noise.Comparison        # 2n against n (higher is better), the rerun in each block
    floor: float                        # the rate's A/A band at n (±)
    bandwidth_ratio: float | None       # probed read GB/s at 2n ÷ at n (None: not probed)

    @property
    def ratio(self) -> float:
        """Median paired ratio, rate at 2n ÷ rate at n."""
        return self.comparison.interval.median

    @property
    def gained(self) -> bool:
        """2n threads called faster by the test."""
        return self.comparison.decided and self.ratio > 1

    @property
    def beyond_bandwidth(self) -> bool | None:
        """A second thread gained more than the bandwidth it adds, beyond the A/A band (None: the
        bandwidth at 2n was not probed)."""
        if self.bandwidth_ratio is None:
            return None
        return self.gained and self.ratio > self.bandwidth_ratio * (1 + self.floor)

    def text(self, what: str = "rate") -> str:
        n, m = self.threads
        bw = (f"the bandwidth probe read {self.bandwidth_ratio:.2f}× as much on {m} threads as on {n}"
              if self.bandwidth_ratio is not None else f"the bandwidth was not probed on {m} threads")
        return f"Thread check: {verdict_sentence(self.comparison, what).rstrip('.')}; {bw}."


def thread_check(rate_n, rate_2n, rate_n_aa, *, threads: tuple[int, int] = (1, 2),
                 bandwidth_ratio: float | None = None) -> ThreadCheck:
    """Judge a phase's rate at 2n threads against n, with n's A/A rerun (`noise.compare`).

    Args:
        rate_n, rate_2n, rate_n_aa: tok/s per block (pair i = block i), n, 2n, n again.
        threads: (n, 2n); bandwidth_ratio: probed read GB/s at 2n ÷ at n.
    """
    floor = noise.noise_floor(rate_n, rate_n_aa)
    labels = tuple(f"{t} thread{'s' if t > 1 else ''}" for t in threads)
    c = noise.compare(rate_n, rate_2n, floor, higher_is_better=True, labels=labels)
    return ThreadCheck(tuple(threads), c, floor.floor, bandwidth_ratio)


@dataclass(frozen=True)
class PhaseRegime:
    """What bound one phase of one stream, with the shares it was read from."""
    phase: str
    label: str        # bandwidth-bound, compute-bound, NEITHER, not bandwidth-bound, too close to call, not judged
    rate: float
    memory_share: float
    compute_share: float          # NaN: no compute roof of this kernel's data type
    threads: ThreadCheck | None
    judged: bool                  # False: no noise band for the rate, the label is a reading
    text: str

    @property
    def bound(self) -> str:
        """One word for an exercise: "bandwidth", "compute", "neither" or "unknown"."""
        return {"bandwidth-bound": "bandwidth", "compute-bound": "compute", NEITHER: "neither"}.get(self.label, "unknown")

    @property
    def short(self) -> str:
        """The label and its numbers in one line, for a Summary."""
        comp = f", {_pct(self.compute_share)} of the compute roof" if math.isfinite(self.compute_share) else ""
        t = self.threads
        th = f"; {t.threads[1]} threads: {t.ratio:.2f}× ({t.comparison.verdict})" if t is not None else ""
        return (f"**{self.label}**{'' if self.judged else ' (a reading)'} ({_pct(self.memory_share)} of the bandwidth "
                f"roof{comp}{th})")


def phase_regime(phase: str, rate_tok_per_s: float, *, bytes_per_token: float, flops_per_token: float,
                 bandwidth_gbs: float, compute_gflops: float | None = None, compute_source: str = "",
                 bandwidth_source: str = "", floor: float | None = None,
                 threads: ThreadCheck | None = None) -> PhaseRegime:
    """Say what bound one phase's measured rate, from the run's numbers (module docstring).

    Args:
        phase: "Decode", "Prefill at 1,024 tokens"... (the sentence's subject).
        rate_tok_per_s: the measured rate.
        bytes_per_token: bytes a token reads (decode: weights + KV; prefill: weights ÷ tokens
            per pass); flops_per_token: 2 × the params it multiplies.
        bandwidth_gbs: the probed read bandwidth on the same thread count; bandwidth_source:
            how it was probed (for the sentence).
        compute_gflops: a compute roof of this kernel's data type (None: none was measured);
            compute_source: what it is.
        floor: the rate's A/A noise band (±); None: one run, the label is a reading.
        threads: a `thread_check` of this phase (None: not run).
    """
    m = rate_tok_per_s * bytes_per_token / (bandwidth_gbs * 1e9)
    c = rate_tok_per_s * flops_per_token / (compute_gflops * 1e9) if compute_gflops else math.nan
    f = floor or 0.0
    bw_src = f", {bandwidth_source}" if bandwidth_source else ""
    out = [f"{phase} ran at {_tok(rate_tok_per_s)} tok/s ({1e3 / rate_tok_per_s:.3g} ms a token). At that pace its "
           f"{bytes_per_token / 1e6:.3g} MB a token stream at {m * bandwidth_gbs:.3g} GB/s: **{_pct(m)} of the "
           f"{bandwidth_gbs:.3g} GB/s probed**{bw_src}" + (f" (memory idle about {1 - m:.0%} of the time)." if m <= 1
                                                           else ".")]
    if compute_gflops:
        out.append(f"Its {flops_per_token / 1e9:.3g} GFLOP a token run at {c * compute_gflops:.3g} GFLOP/s: **{_pct(c)} "
                   f"of the compute roof** ({compute_gflops:.3g} GFLOP/s, {compute_source}).")
    else:
        out.append(f"No compute roof of this kernel's data type was measured ({compute_source or 'none given'}).")
    if threads is not None:
        out.append(threads.text(f"{phase.split(' ')[0].lower()} tok/s"))
    mem = "wrong" if m > 1 else _side(m / (1 + f), m * (1 + f), NEAR_ROOF)
    comp = "none" if not compute_gflops else "wrong" if c > 1 else _side(c / (1 + f), c * (1 + f), NEAR_ROOF)
    beyond = threads is not None and threads.beyond_bandwidth is True
    band = f"the rate's A/A band (±{f:.0%})"
    if mem == "above" and not beyond:
        label, why = "bandwidth-bound", f"it reached {_pct(m)} of the bandwidth roof"
    elif mem == "above":
        label, why = "too close to call", (f"it reached {_pct(m)} of the bandwidth roof, yet a second thread raised it "
                                           f"{threads.ratio:.2f}×, more than the {threads.bandwidth_ratio:.2f}× bandwidth "
                                           "it adds: memory was not all that held one thread")
    elif comp == "above":
        label, why = "compute-bound", f"it reached {_pct(c)} of the compute roof"
    elif "unsure" in (mem, comp):
        label, why = "too close to call", f"within {band} it may or may not have reached half a roof"
    elif mem == "wrong":
        label, why = "not judged", (f"its rate sits above the bandwidth roof ({_pct(m)}): that roof is wrong here (the "
                                    "bytes came faster than the probe read memory: from a cache, or the probe "
                                    "under-read), so no regime is read from it")
    elif comp in ("none", "wrong"):
        label = "not bandwidth-bound"
        why = (f"it used {_pct(m)} of the bandwidth roof; with " + ("no compute roof of its data type" if comp == "none"
               else f"its rate above the compute roof ({_pct(c)}: a probe of another data type)")
               + ", this run cannot tell compute-bound from kernel/overhead-bound")
    else:
        label = NEITHER
        why = (f"neither roof is near: {_pct(m)} of the bandwidth roof and {_pct(c)} of the compute roof. The time goes "
               "to what neither roof counts: the kernel's own pace on these threads (loads in flight, any unpacking "
               "of quantized blocks) and per-step overhead (synchronization, sampling, the loop around the model)")
        if threads is not None and threads.gained:
            why += f"; a second thread raised it {threads.ratio:.2f}×, so the work divides among threads"
        elif threads is not None and threads.comparison.within_noise:
            why += ("; a second thread did not raise it beyond noise: a part that does not divide among threads, "
                    "or no free core for it")
    note = "" if floor is not None else " (one run: no noise band, a reading)"
    out.append(f"The regime is **{label}**{note}: {why}.")
    return PhaseRegime(phase, label, rate_tok_per_s, m, c, threads, floor is not None, " ".join(out))
