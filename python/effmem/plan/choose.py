"""Which of effmem plan's candidates fit, why each of the others lost, and the pick."""
from dataclasses import dataclass
from typing import Dict, List, Optional

from effmem.plan import costs
from effmem.plan.report import size_text

GB = 10 ** 9
# Candidates predicted within this fraction of the fastest one's step count as equally fast (the step model
# is good to about 10%): among them the pick is the one that changes the numbers least (Config.approximations),
# then one that needs no host memory, then the fastest; between equally fast ones, the one holding least in
# host memory, then on the GPU. A few percent do not pay for 8-bit moments, or for an offload engine, that the
# model does not need.
PICK_TOLERANCE = 0.03


@dataclass
class Candidate:
    """One configuration a plan considered: what it is (config), its predicted memory (cost: peak_bytes,
    parts, host bytes), its predicted step time by part (time_parts, seconds), whether it fits and, if not, why."""
    config: costs.Config
    cost: costs.Cost
    time_parts: Dict[str, float]
    fits: bool = False
    why: str = ""
    # bytes over the GPU budget plus bytes over the host's 90% (0 where it fits, or fails for another
    # reason): what orders the candidates that do not fit, and names the closest when nothing does
    short_bytes: int = 0
    ruled_out: bool = False   # whatever the memory: by the recipe (overlap mode under clipping), or no host link

    @property
    def name(self) -> str:
        """The configuration's name, as the report, the JSON and Plan.candidate(name) use it."""
        return self.config.name

    @property
    def step_time_s(self) -> float:
        """The predicted optimizer step's time, seconds: the sum of time_parts."""
        return sum(self.time_parts.values())

    def as_dict(self) -> dict:
        """The candidate as the JSON contract has it (an entry of ``Plan.as_dict()["candidates"]``)."""
        parts = {k: v for k, v in self.cost.parts.items() if k != "activations_by_kind"}
        c = self.config
        return {"name": self.name, "fits": self.fits, "peak_bytes": self.cost.peak_bytes,
                "allocated_bytes": self.cost.allocated_bytes, "host_bytes": self.cost.host_bytes,
                "step_time_s": self.step_time_s, "parts": parts,
                "activations_by_kind": self.cost.parts["activations_by_kind"], "time_parts": self.time_parts,
                "precision": c.precision, "activations": c.activations, "optimizer": c.optimizer,
                "sharding": c.sharding, "micro_batch": c.micro_batch, "accumulation": c.accumulation,
                "loss": c.loss, "state_bits": c.state_bits, "device_accumulation": c.device_accumulation,
                "device_state": c.device_state,
                "activation_budget": self.cost.activation_budget,
                "short_bytes": self.short_bytes, "why": self.why}


def _pick(fitting: List[Candidate]) -> Optional[Candidate]:
    """The fastest candidate that fits, or, among those within PICK_TOLERANCE of it, the most exact, then one
    without host memory, then the fastest, then the one holding least in host memory."""
    if not fitting:
        return None
    fastest = min(c.step_time_s for c in fitting)
    near = [c for c in fitting if c.step_time_s <= fastest * (1 + PICK_TOLERANCE)]
    # step times to 9 digits: host-bound candidates take the host's time, equal but for float rounding, and the
    # smaller of them is the pick
    return min(near, key=lambda c: (c.config.approximations, c.cost.host_bytes > 0, float(f"{c.step_time_s:.9g}"),
                                    c.cost.host_bytes, c.cost.peak_bytes))


def _why_not(c: Candidate, best: Candidate) -> str:
    """Why a candidate that fits is not the pick."""
    slower = c.step_time_s / best.step_time_s - 1
    if slower > 0:
        return f"fits, {slower:.1%} slower than the pick"
    reason = ("changes the numbers more (8-bit moments or activations)"
              if c.config.approximations > best.config.approximations else "holds more in host memory"
              if c.cost.host_bytes > best.cost.host_bytes else "holds more on the GPU")
    if -slower < 0.0005:
        return f"fits, as fast as the pick but {reason}"
    return f"fits, {-slower:.1%} faster than the pick (within {PICK_TOLERANCE:.0%}) but {reason}"


def judge(cands: List[Candidate], budget: float, gpu_mem: int, host_mem: int, headroom: float,
          clipping: bool) -> Optional[Candidate]:
    """Mark each candidate fits or not, with why; sort them (the pick first, then the others that fit by
    step time, then the rest by the bytes they are short); return the pick (None: nothing fits)."""
    for c in cands:
        over = c.cost.peak_bytes - budget
        host_over = c.cost.host_bytes - host_mem * 0.9
        c.short_bytes = int(max(0.0, over) + max(0.0, host_over))
        short = []
        if over > 0:
            short.append(f"needs {size_text(c.cost.peak_bytes)}, {size_text(over)} over the {size_text(budget)} "
                         f"budget ({size_text(gpu_mem)} less {headroom:.0%} headroom)")
        if host_over > 0:
            short.append(f"needs {size_text(c.cost.host_bytes)} of host memory, {size_text(host_over)} over 90% "
                         f"of {size_text(host_mem)}")
        ruled_out = ("overlap mode rules out clipping by global norm (plan with clipping=False, or --no-clipping, "
                     "to allow it)"
                     if clipping and c.config.optimizer == "offload_overlap" else
                     "not possible here (no host link)" if c.step_time_s == float("inf") else "")
        c.ruled_out = bool(ruled_out)
        if short:
            c.why = "does not fit: " + "; and ".join(short) + (f" (and {ruled_out})" if ruled_out else "")
        elif ruled_out:
            c.why = ruled_out
        else:
            c.fits = True
    best = _pick([c for c in cands if c.fits])
    for c in cands:
        if c.fits and c is not best:
            c.why = _why_not(c, best)
    if best is not None:
        fastest = min(c.step_time_s for c in cands if c.fits)
        best.why = ("the pick: fastest that fits" if best.step_time_s <= fastest * 1.0005 else
                    f"the pick: {best.step_time_s / fastest - 1:.1%} slower than the fastest that fits (within "
                    f"{PICK_TOLERANCE:.0%}, exact math first, then less host memory)")
    # those that do not fit by the bytes they are short, those ruled out besides (the closest named is one that
    # more memory would make the pick) last
    cands.sort(key=lambda c: (not c.fits, c is not best,
                              c.step_time_s if c.fits else (c.ruled_out, c.short_bytes, c.cost.peak_bytes)))
    return best
