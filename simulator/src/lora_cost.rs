//! The LoRA adapters a simulation prices (`scheduler.lora`): their rank and the projections
//! they adapt, from which the roofline ([`crate::cost`]) counts the adapters' weights per layer
//! (`rank * Σ (in + out)`, Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models",
//! ICLR 2022).

use crate::cost::ModelSpec;
use serde::{Deserialize, Serialize};

/// A projection of a decoder layer that a LoRA adapter may adapt (PEFT's module names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Projection {
    /// `self_attn.q_proj`.
    #[serde(rename = "q_proj")]
    Q,
    /// `self_attn.k_proj`.
    #[serde(rename = "k_proj")]
    K,
    /// `self_attn.v_proj`.
    #[serde(rename = "v_proj")]
    V,
    /// `self_attn.o_proj`.
    #[serde(rename = "o_proj")]
    O,
    /// `mlp.gate_proj`.
    #[serde(rename = "gate_proj")]
    Gate,
    /// `mlp.up_proj`.
    #[serde(rename = "up_proj")]
    Up,
    /// `mlp.down_proj`.
    #[serde(rename = "down_proj")]
    Down,
}

impl Projection {
    /// Every projection, in a layer's order.
    pub const ALL: [Projection; 7] = [
        Projection::Q,
        Projection::K,
        Projection::V,
        Projection::O,
        Projection::Gate,
        Projection::Up,
        Projection::Down,
    ];

    /// Its input and output widths in `model`.
    pub fn dims(self, model: &ModelSpec) -> (u64, u64) {
        let (h, q, kv, f) = (
            model.hidden_size,
            model.q_dim(),
            model.kv_dim(),
            model.ffn_size,
        );
        match self {
            Projection::Q => (h, q),
            Projection::K | Projection::V => (h, kv),
            Projection::O => (q, h),
            Projection::Gate | Projection::Up => (h, f),
            Projection::Down => (f, h),
        }
    }
}

/// Largest LoRA rank a spec accepts (the server's loader's, `switchyard_gpu::lora::MAX_LORA_RANK`).
pub const MAX_LORA_RANK: u64 = 1024;

/// The LoRA adapters a simulation's requests name (trace records' `adapter`), as the roofline
/// prices them: every adapter of this rank on these projections of every layer
/// (`scheduler.lora`; a calibration file's fitted terms price them instead).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoraSpec {
    /// The adapters' rank (1..=1024, at most the model's hidden size; default 16, vLLM's
    /// `max_lora_rank`).
    pub rank: u64,
    /// The adapted projections: `all` (the default, PEFT's `all-linear`) or a list of
    /// `q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`.
    #[serde(deserialize_with = "lora_targets")]
    pub targets: Vec<Projection>,
}

impl Default for LoraSpec {
    fn default() -> Self {
        LoraSpec {
            rank: 16,
            targets: Projection::ALL.to_vec(),
        }
    }
}

/// `all` or a list of projection names.
fn lora_targets<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<Projection>, D::Error> {
    use serde::de::Error;
    const WHAT: &str = "`all` or a list of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, \
                        down_proj";
    match serde_yaml::Value::deserialize(d)? {
        serde_yaml::Value::String(s) if s == "all" => Ok(Projection::ALL.to_vec()),
        v @ serde_yaml::Value::Sequence(_) => serde_yaml::from_value(v)
            .map_err(|e| D::Error::custom(format!("lora.targets is {WHAT}: {e}"))),
        _ => Err(D::Error::custom(format!("lora.targets is {WHAT}"))),
    }
}

impl LoraSpec {
    /// Checks the rank against its bounds and `model`, and the targets: at least one, none
    /// twice.
    pub fn validate(&self, model: &ModelSpec) -> Result<(), String> {
        let most = MAX_LORA_RANK.min(model.hidden_size);
        if !(1..=most).contains(&self.rank) {
            return Err(format!(
                "scheduler.lora.rank = {} outside 1..={most} (at most {MAX_LORA_RANK}, and a \
                 low-rank update of rank above the model's hidden size {} is no low-rank update)",
                self.rank, model.hidden_size
            ));
        }
        if self.targets.is_empty() {
            return Err(
                "scheduler.lora.targets is empty: an adapter adapts at least one \
                        projection"
                    .into(),
            );
        }
        for (i, t) in self.targets.iter().enumerate() {
            if self.targets[..i].contains(t) {
                return Err(format!("scheduler.lora.targets names {t:?} twice"));
            }
        }
        Ok(())
    }

    /// Weights of one adapter in one layer: `rank * Σ (in + out)` over its projections.
    pub fn params_per_layer(&self, model: &ModelSpec) -> u64 {
        self.targets
            .iter()
            .map(|t| {
                let (i, o) = t.dims(model);
                self.rank * (i + o)
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lora_specs_are_bounded() {
        let m = ModelSpec::smollm2_135m();
        assert!(LoraSpec::default().validate(&m).is_ok());
        assert_eq!(LoraSpec::default().targets.len(), 7);
        let parse = |y: &str| serde_yaml::from_str::<LoraSpec>(y);
        let qv = parse("{rank: 8, targets: [q_proj, v_proj]}").unwrap();
        assert_eq!(qv.targets, vec![Projection::Q, Projection::V]);
        assert_eq!(parse("{targets: all}").unwrap(), LoraSpec::default());
        assert_eq!(parse("{rank: 4}").unwrap().targets.len(), 7);
        for bad in [
            "{targets: some}",
            "{targets: [qkv_proj]}",
            "{rank: 4, alpha: 8}",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        let check = |y: &str| parse(y).unwrap().validate(&m).unwrap_err();
        assert!(check("{rank: 0}").contains("rank = 0 outside 1..=576"));
        assert!(check("{rank: 577}").contains("outside 1..=576"));
        assert!(check("{targets: []}").contains("empty"));
        assert!(check("{targets: [q_proj, q_proj]}").contains("twice"));
        let big = ModelSpec::llama_3_8b();
        assert!(parse("{rank: 1024}").unwrap().validate(&big).is_ok());
        assert!(parse("{rank: 1025}").unwrap().validate(&big).is_err());
    }
}
