//! Which fusions the graph builder declares. Defaults come from the env-switch registry.

use ferrite_core::env;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FusionOptions {
    /// Q, K and V projections as one linear over a concatenated weight.
    pub qkv: bool,
    /// Gate and up projections as one linear.
    pub gate_up: bool,
    /// RMSNorm folded into the prologue of the (fused) projection that consumes it. Only applied
    /// when that projection is a single linear: an unfused group would recompute the norm.
    pub norm_into_linear: bool,
    /// Residual add folded into the epilogue of the output/down projections.
    pub residual_into_linear: bool,
    /// The MLP's gate activation (SwiGLU/GeGLU) folded into the epilogue of the fused gate/up
    /// linear (needs `gate_up`).
    pub glu_into_linear: bool,
    /// RoPE of Q and K applied by the attention op as it stores K and reads Q, instead of a
    /// separate in-place op.
    pub rope_into_attention: bool,
}

impl FusionOptions {
    pub const ALL: Self = Self {
        qkv: true,
        gate_up: true,
        norm_into_linear: true,
        residual_into_linear: true,
        glu_into_linear: true,
        rope_into_attention: true,
    };
    pub const NONE: Self = Self {
        qkv: false,
        gate_up: false,
        norm_into_linear: false,
        residual_into_linear: false,
        glu_into_linear: false,
        rope_into_attention: false,
    };

    /// All fusions on, except those disabled by `FERRITE_DISABLE_*_FUSION=1`.
    pub fn from_env() -> Self {
        Self {
            qkv: !env::DISABLE_QKV_FUSION.flag(false),
            gate_up: !env::DISABLE_GATE_UP_FUSION.flag(false),
            norm_into_linear: !env::DISABLE_NORM_FUSION.flag(false),
            residual_into_linear: !env::DISABLE_RESIDUAL_FUSION.flag(false),
            glu_into_linear: !env::DISABLE_GLU_FUSION.flag(false),
            rope_into_attention: !env::DISABLE_ROPE_FUSION.flag(false),
        }
    }
}

impl Default for FusionOptions {
    fn default() -> Self {
        Self::from_env()
    }
}
