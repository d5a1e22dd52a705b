"""The incumbent baselines' configs (compressors/powersgd.py, signsgd.py, qsgd.py), in the method
registry (registry.py) beside the project's own, so every adapter and engine takes them by name."""
from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import ConfigDict, Field

from .compression import CompressionConfig


class PowerSGDConfig(CompressionConfig):
    """PowerSGD: each matrix as a rank-r product P Q^T, two allreduces per layer, error feedback."""
    model_config = ConfigDict(extra="forbid")
    method: Literal["powersgd"] = "powersgd"
    sharded_limits: ClassVar[Optional[str]] = "sends each layer as two allreduces, P and then Q from the reduced P"
    rank: int = Field(
        2, ge=1, description="columns of P and Q: a layer of n x m sends (n + m) * rank values instead of "
                             "n * m. Higher is closer to the gradient, sends more and costs two n*m*rank "
                             "products per step; 1 to 4 is usual (start at 1, double until accuracy holds)")
    start_iter: int = Field(
        0, ge=0, description="steps of plain allreduce before compression starts (torch's start_powerSGD_iter): "
                             "early training is the most sensitive to compression error; torch suggests about "
                             "10% of the steps. Residuals are per parameter here, so 0 is allowed under DDP")
    min_compression_rate: float = Field(
        2.0, gt=0, description="factorise a layer only when n * m > rate * (n + m) * rank (torch's rule): "
                               "below it the bytes saved do not pay for the products and the error")
    warm_start: bool = Field(
        True, description="start each step's power iteration from the previous averaged Q: one iteration per "
                          "step then tracks the top subspace over steps. false draws a fresh Q every step "
                          "(worse approximations, no Q kept per layer)")
    orthogonalization: Literal["auto", "gram_schmidt", "qr"] = Field(
        "auto", description="auto: Gram-Schmidt up to rank 2, Householder QR above (torch's choice; QR is "
                            "faster at higher rank and steadier)")
    orthogonalization_epsilon: float = Field(
        0.0, ge=0, description="added to each column norm in Gram-Schmidt. 0 is exact (a zero column stays "
                               "zero); a small value (1e-8) damps near-zero columns instead")
    seed: int = Field(0, description="seed of Q's first draw, the same on every worker (numpy RandomState, "
                                     "as torch's hook)")
    residual: bool = Field(
        True, description="error feedback: keep M - P^ Q_avg^T and add it to the next gradient. Without it "
                          "PowerSGD is biased and usually loses accuracy (Vogels et al., section 3)")

    @property
    def uses_memory(self) -> bool:  # type: ignore[override]
        return self.residual


class SignSGDConfig(CompressionConfig):
    """EF-signSGD: one bit per element plus one scale per layer, with error feedback."""
    model_config = ConfigDict(extra="forbid")
    method: Literal["signsgd"] = "signsgd"
    sharded_limits: ClassVar[Optional[str]] = "allgathers signs and scales that only decode whole"
    residual: bool = Field(
        True, description="error feedback (EF-signSGD): keep p - scale * sign(p) and add it to the next "
                          "gradient. Without it this is scaled signSGD, which is biased and can fail to "
                          "converge (Karimireddy et al., ICML 2019, section 3); with it the residual costs "
                          "one fp32 buffer per compressed layer")

    @property
    def uses_memory(self) -> bool:  # type: ignore[override]
        return self.residual


class QSGDConfig(CompressionConfig):
    """QSGD: s-level stochastic rounding per bucket, unbiased; norms plus packed codes by allgather."""
    model_config = ConfigDict(extra="forbid")
    method: Literal["qsgd"] = "qsgd"
    sharded_limits: ClassVar[Optional[str]] = "allgathers quantised gradients that only decode whole"
    bits: Literal[2, 4, 8] = Field(
        4, description="bits per element, sign included, for s = 2**(bits-1) - 1 levels (2: s=1, ternary; "
                       "4: s=7; 8: s=127). Fewer bits send fewer bytes (32/bits x less than fp32) but add "
                       "variance: at most min(d/s^2, sqrt(d)/s) * ||v||^2 per bucket of d elements")
    bucket_size: int = Field(
        512, ge=1, description="elements sharing one norm (the paper's bucketing; 512 in its experiments). "
                               "Smaller buckets lower the variance bound (d is the bucket size) and add "
                               "4 bytes per bucket")
    residual: bool = Field(
        False, description="error feedback: keep the rounding noise v - Q(v) and add it to the next gradient. "
                           "QSGD is unbiased and converges without it (the paper's setting); with it the noise "
                           "is resent instead of averaged away, at one fp32 buffer per layer")
    seed: int = Field(
        0, description="seed of the stochastic rounding, combined with the rank, the step and the layer: "
                       "workers draw independent noise (it averages out) and a resumed run draws the same")

    @property
    def uses_memory(self) -> bool:  # type: ignore[override]
        return self.residual
