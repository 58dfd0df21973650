//! The configuration schema: sections, defaults and the rules that span fields.
//!
//! Every number a file controls is bounded here, while deserializing, so that the YAML parser
//! reports the line of an out-of-range value.

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use std::collections::BTreeMap;
use std::fmt;

// The checks run inside the visitors, while the parser is at the value: an error raised there
// is located at the value's own line and named by its full path (`cache.kv_cache_mb`). A check
// made after `u64::deserialize` returned was located by the enclosing section instead (its
// first key's line).

/// The message of an integer outside `MIN..=MAX`.
fn out_of_range<E: de::Error>(v: impl fmt::Display, min: u64, max: u64) -> E {
    E::custom(format!("{v} is out of range {min}..={max}"))
}

/// Visits an integer in `MIN..=MAX`.
struct IntIn<const MIN: u64, const MAX: u64>;

impl<const MIN: u64, const MAX: u64> Visitor<'_> for IntIn<MIN, MAX> {
    type Value = u64;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "an integer in {MIN}..={MAX}")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
        if (MIN..=MAX).contains(&v) {
            Ok(v)
        } else {
            Err(out_of_range(v, MIN, MAX))
        }
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
        match u64::try_from(v) {
            Ok(v) => self.visit_u64(v),
            Err(_) => Err(out_of_range(v, MIN, MAX)),
        }
    }

    fn visit_u128<E: de::Error>(self, v: u128) -> Result<u64, E> {
        match u64::try_from(v) {
            Ok(v) => self.visit_u64(v),
            Err(_) => Err(out_of_range(v, MIN, MAX)),
        }
    }

    fn visit_i128<E: de::Error>(self, v: i128) -> Result<u64, E> {
        match u64::try_from(v) {
            Ok(v) => self.visit_u64(v),
            Err(_) => Err(out_of_range(v, MIN, MAX)),
        }
    }
}

/// Deserializes an integer and checks it lies in `MIN..=MAX`.
pub(crate) fn int_in<'de, D: Deserializer<'de>, const MIN: u64, const MAX: u64>(
    d: D,
) -> Result<u64, D::Error> {
    d.deserialize_any(IntIn::<MIN, MAX>)
}

fn usize_in<'de, D: Deserializer<'de>, const MIN: u64, const MAX: u64>(
    d: D,
) -> Result<usize, D::Error> {
    let v = int_in::<D, MIN, MAX>(d)?;
    usize::try_from(v).map_err(de::Error::custom)
}

/// The sizes `cache.block_size` takes: the powers of two from 1 to 1024. The backends and
/// the block pool would run any size in that range, but every size an engine offers is one
/// of these (vLLM's `--block-size` choices are 1, 8, 16, 32, 64, 128 and 256), the pool maps
/// a token to its block by a shift only for them, and 7 or 100 is a typo far more often
/// than a choice.
pub const BLOCK_SIZES: [usize; 11] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024];

/// Visits an integer of [`BLOCK_SIZES`]; another is refused naming them. The check is made
/// while visiting the value, as [`IntIn`]'s, so that the error is located at the value.
struct BlockSize;

impl BlockSize {
    fn check<E: de::Error>(v: u64) -> Result<u64, E> {
        if BLOCK_SIZES.iter().any(|&s| s as u64 == v) {
            return Ok(v);
        }
        let sizes: Vec<String> = BLOCK_SIZES.iter().map(usize::to_string).collect();
        Err(E::custom(format!(
            "{v} is not a block size: it takes a power of two, one of {}",
            sizes.join(", ")
        )))
    }
}

impl Visitor<'_> for BlockSize {
    type Value = u64;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a power of two in 1..=1024")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
        IntIn::<1, 1024>.visit_u64(v).and_then(Self::check)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
        IntIn::<1, 1024>.visit_i64(v).and_then(Self::check)
    }

    fn visit_u128<E: de::Error>(self, v: u128) -> Result<u64, E> {
        IntIn::<1, 1024>.visit_u128(v).and_then(Self::check)
    }

    fn visit_i128<E: de::Error>(self, v: i128) -> Result<u64, E> {
        IntIn::<1, 1024>.visit_i128(v).and_then(Self::check)
    }
}

/// `cache.block_size`: an integer of [`BLOCK_SIZES`].
fn block_size<'de, D: Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
    let v = d.deserialize_any(BlockSize)?;
    usize::try_from(v).map_err(de::Error::custom)
}

/// `null` (None) or an integer in `MIN..=MAX`.
fn opt_usize_in<'de, D: Deserializer<'de>, const MIN: u64, const MAX: u64>(
    d: D,
) -> Result<Option<usize>, D::Error> {
    struct OptIntIn<const MIN: u64, const MAX: u64>;
    impl<'de, const MIN: u64, const MAX: u64> Visitor<'de> for OptIntIn<MIN, MAX> {
        type Value = Option<usize>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "an integer in {MIN}..={MAX} or null")
        }
        fn visit_none<E: de::Error>(self) -> Result<Option<usize>, E> {
            Ok(None)
        }
        fn visit_unit<E: de::Error>(self) -> Result<Option<usize>, E> {
            Ok(None)
        }
        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Option<usize>, D::Error> {
            usize_in::<D, MIN, MAX>(d).map(Some)
        }
    }
    d.deserialize_option(OptIntIn::<MIN, MAX>)
}

/// `null` (None) or an integer in `MIN..=MAX`, as a `u64`.
fn opt_u64_in<'de, D: Deserializer<'de>, const MIN: u64, const MAX: u64>(
    d: D,
) -> Result<Option<u64>, D::Error> {
    opt_usize_in::<D, MIN, MAX>(d).map(|v| v.map(|v| v as u64))
}

fn u16_in<'de, D: Deserializer<'de>, const MIN: u64, const MAX: u64>(
    d: D,
) -> Result<u16, D::Error> {
    let v = int_in::<D, MIN, MAX>(d)?;
    u16::try_from(v).map_err(de::Error::custom)
}

/// Visits a number (an integer is taken as a float) that `check` accepts; `expecting` says
/// what is accepted.
struct Checked {
    check: fn(f64) -> Result<f64, String>,
    expecting: &'static str,
}

impl Visitor<'_> for Checked {
    type Value = f64;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.expecting)
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<f64, E> {
        (self.check)(v).map_err(E::custom)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<f64, E> {
        self.visit_f64(v as f64)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<f64, E> {
        self.visit_f64(v as f64)
    }
}

/// Visits `null` (None) or a number `Checked` accepts.
struct OptChecked(Checked);

impl<'de> Visitor<'de> for OptChecked {
    type Value = Option<f64>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} or null", self.0.expecting)
    }

    fn visit_none<E: de::Error>(self) -> Result<Option<f64>, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Option<f64>, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Option<f64>, D::Error> {
        d.deserialize_any(self.0).map(Some)
    }
}

/// A number in (0, 1].
const FRACTION: Checked = Checked {
    check: |v| {
        if v > 0.0 && v <= 1.0 {
            Ok(v)
        } else {
            Err(format!(
                "{} must be in (0, 1]",
                crate::short_number::short_number(v)
            ))
        }
    },
    expecting: "a number in (0, 1]",
};

fn fraction<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    d.deserialize_any(FRACTION)
}

fn opt_fraction<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    d.deserialize_option(OptChecked(FRACTION))
}

fn opt_positive_ms<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    d.deserialize_option(OptChecked(Checked {
        check: |v| {
            if v.is_finite() && v > 0.0 && v <= 3_600_000.0 {
                Ok(v)
            } else {
                Err(format!(
                    "{} must be a positive number of milliseconds (at most one hour)",
                    crate::short_number::short_number(v)
                ))
            }
        },
        expecting: "a positive number of milliseconds",
    }))
}

/// Most KV blocks `cache.num_blocks` may name.
pub const MAX_NUM_BLOCKS: usize = 1 << 24;

/// Most GiB of host memory `cache.kv_offloading_size` may ask for.
pub const MAX_KV_OFFLOADING_GIB: f64 = 1024.0;

/// Most CPU threads the CPU backend takes (`model.threads`, and the `--threads` flag of
/// `generate` and `bench throughput`): each is an OS thread with its own stack, so an
/// unbounded count exhausts memory before the backend starts.
pub const MAX_CPU_THREADS: usize = 1024;

fn offloading_gib<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    d.deserialize_any(Checked {
        check: |v| {
            if v.is_finite() && (0.0..=MAX_KV_OFFLOADING_GIB).contains(&v) {
                Ok(v)
            } else {
                Err(format!(
                    "{} must be a size in GiB in 0..={MAX_KV_OFFLOADING_GIB} (0: no host tier)",
                    crate::short_number::short_number(v)
                ))
            }
        },
        expecting: "a size in GiB in 0..=1024",
    })
}

fn weight<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    d.deserialize_any(Checked {
        check: |v| {
            if v.is_finite() && (1e-3..=1e6).contains(&v) {
                Ok(v)
            } else {
                Err(format!(
                    "{} must be a weight in 0.001..=1e6",
                    crate::short_number::short_number(v)
                ))
            }
        },
        expecting: "a weight in 0.001..=1e6",
    })
}

/// The whole configuration file.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(
    deny_unknown_fields,
    default,
    expecting = "a mapping of sections (model, server, cache, scheduler, tiers, logging, lora, speculative)"
)]
pub struct Config {
    /// Which model to serve and on which backend.
    pub model: ModelSection,
    /// HTTP listener, keys and limits.
    pub server: ServerSection,
    /// KV cache geometry.
    pub cache: CacheSection,
    /// Batching limits and the scheduling policy.
    pub scheduler: SchedulerSection,
    /// SLO tiers by name (e.g. premium, standard, batch); each name is checked at its key.
    #[serde(deserialize_with = "crate::deserialize_tiers")]
    pub tiers: BTreeMap<String, TierConfig>,
    /// Logging.
    pub logging: LoggingSection,
    /// LoRA adapters served on top of the model.
    pub lora: LoraSection,
    /// Speculative decoding; absent: one token per decode step.
    pub speculative: Option<SpeculativeSection>,
}

/// How draft tokens are proposed.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum SpeculativeMethod {
    /// Prompt lookup: the tokens that followed an earlier occurrence of the sequence's last
    /// few tokens (no draft model).
    #[default]
    Ngram,
}

/// The `speculative:` section (vLLM's `speculative_config`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(
    deny_unknown_fields,
    default,
    expecting = "a mapping (the speculative section)"
)]
pub struct SpeculativeSection {
    /// How drafts are proposed.
    pub method: SpeculativeMethod,
    /// Most draft tokens per sequence and step.
    #[serde(deserialize_with = "usize_in::<_, 1, 16>")]
    pub num_speculative_tokens: usize,
    /// Shortest suffix that must match (at most `prompt_lookup_max`).
    #[serde(deserialize_with = "usize_in::<_, 1, 32>")]
    pub prompt_lookup_min: usize,
    /// Longest suffix matched.
    #[serde(deserialize_with = "usize_in::<_, 1, 32>")]
    pub prompt_lookup_max: usize,
    /// No drafts in a step while more sequences than this run (0: no limit).
    #[serde(deserialize_with = "usize_in::<_, 0, 65536>")]
    pub max_running: usize,
}

impl Default for SpeculativeSection {
    fn default() -> Self {
        Self {
            method: SpeculativeMethod::Ngram,
            num_speculative_tokens: 4,
            prompt_lookup_min: 2,
            prompt_lookup_max: 4,
            max_running: 0,
        }
    }
}

/// Which backend executes the model.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// CUDA when a GPU and the CUDA libraries are present, otherwise CPU.
    #[default]
    Auto,
    /// The CPU backend.
    Cpu,
    /// The CUDA backend (needs the `cuda` feature and a GPU).
    Cuda,
}

/// Whether the engine plans each step while the previous one runs on the device.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum AsyncSchedulingMode {
    /// On with a backend that runs steps asynchronously to the host (CUDA), off on the CPU.
    #[default]
    Auto,
    /// On wherever the backend can pipeline steps (the CPU backend too, which gains nothing).
    On,
    /// Every step planned after the previous step's outputs are applied.
    Off,
}

/// `FromStr` for a choice enum whose command-line names are its YAML names (command-line
/// flags); the error lists the names.
macro_rules! choice_from_str {
    ($ty:ident { $($name:literal => $variant:ident),+ $(,)? }) => {
        impl std::str::FromStr for $ty {
            type Err = String;

            fn from_str(v: &str) -> Result<Self, String> {
                match v {
                    $($name => Ok(Self::$variant),)+
                    other => Err(format!(
                        "`{other}`: expected one of {}",
                        [$($name),+].join(", ")
                    )),
                }
            }
        }
    };
}

choice_from_str!(AsyncSchedulingMode { "auto" => Auto, "on" => On, "off" => Off });

/// How weights are obtained.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LoadFormat {
    /// Decide from the path: a `.gguf` file or a Hugging Face directory.
    #[default]
    Auto,
    /// A GGUF file.
    Gguf,
    /// A Hugging Face directory with config.json and safetensors.
    Safetensors,
    /// Random weights for `model.architecture` (benchmarks without weight files); refused by
    /// [`Config::validate`], since `serve` needs real weights.
    Dummy,
}

/// How the layers' weights are stored on the device.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Quantization {
    /// As loaded: bf16 on the CUDA backend, the file's own types on the CPU backend.
    #[default]
    None,
    /// The CUDA backend quantizes each layer's matrices to fp8 (e4m3, a scale per output
    /// channel) at load: half the weight bytes, fp8 tensor cores for large steps (their
    /// activations quantized per token). Needs a GPU of compute capability 8.9 or newer (Ada,
    /// Hopper).
    Fp8,
}

choice_from_str!(Quantization { "none" => None, "fp8" => Fp8 });

/// Precision of the activations the CPU backend feeds its quantized matrix products (the
/// GGUF's weights stay as stored).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum CpuPrecision {
    /// The fastest that agrees with the reference at 99 % top-1 on this machine's kernels:
    /// `mixed` with AVX-512 VNNI (and the portable kernels), `precise` with AVX2.
    #[default]
    Auto,
    /// int8 per block of 32 everywhere (llama.cpp's choice): the fastest, the least exact.
    Int8,
    /// About 15 bits for the Q/K/V and down projections, int8 elsewhere.
    Mixed,
    /// About 15 bits for every projection: closest to float32, about twice the multiply work.
    Precise,
}

choice_from_str!(CpuPrecision { "auto" => Auto, "int8" => Int8, "mixed" => Mixed, "precise" => Precise });

/// How the added tokens' text written in a chat's messages is encoded (`<|im_end|>` in a
/// user's message).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum MessageSpecialTokens {
    /// As text, as OpenAI's API encodes it: a message cannot write the control tokens of the
    /// conversation around it (close its turn, open a system turn). The tokens escaped are
    /// the special ones and the other added tokens the chat template writes itself.
    #[default]
    Text,
    /// As the tokens they name, as Hugging Face's `apply_chat_template` and vLLM encode it.
    Tokens,
}

choice_from_str!(MessageSpecialTokens { "text" => Text, "tokens" => Tokens });

/// The format the model writes tool calls in (chat completions with `tools`).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ToolCallFormat {
    /// From the chat template: Mistral v11's for templates that write `[TOOL_CALLS]` and
    /// `[ARGS]`, Mistral's for templates that write `[TOOL_CALLS]` and `[AVAILABLE_TOOLS]`,
    /// Llama 3's for Meta's Llama 3.1-3.3 templates, Hermes otherwise.
    #[default]
    Auto,
    /// `<tool_call>` blocks (Qwen 2.5 and later, Hermes, SmolLM3; any other model).
    Hermes,
    /// Meta's JSON calls, `{"name": ..., "parameters": ...}` (Llama 3.1 to 3.3).
    Llama3Json,
    /// Mistral's list of calls, `[TOOL_CALLS] [{"name": ..., "arguments": ...}]` (Mistral 7B
    /// Instruct v0.3 and the other models of Mistral's v3 tokenizer).
    Mistral,
    /// Mistral's calls from its v11 tokenizers on, `[TOOL_CALLS]name[ARGS]{...}` for each
    /// (Mistral Small 3.2, Magistral, Devstral, Ministral 3).
    MistralV11,
}

choice_from_str!(ToolCallFormat {
    "auto" => Auto,
    "hermes" => Hermes,
    "llama3_json" => Llama3Json,
    "mistral" => Mistral,
    "mistral_v11" => MistralV11,
});

/// Who writes a request's tools, and its conversation's tool calls and results, into the
/// prompt.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ToolPrompt {
    /// `template` when the chat template writes tools, calls and results by itself (Qwen 2.5 and later,
    /// Llama 3.1 to 3.3, Hermes, Mistral), else `server`.
    #[default]
    Auto,
    /// The chat template, given `tools` and messages with `tool_calls` and `tool_call_id`
    /// as Hugging Face's `apply_chat_template` and vLLM give them: the words the model was
    /// trained on.
    Template,
    /// The server, as text in the model's call format, for templates that know nothing of
    /// tools.
    Server,
}

choice_from_str!(ToolPrompt { "auto" => Auto, "template" => Template, "server" => Server });

/// Whether chat answers have their reasoning (`<think>...</think>`, or Mistral's
/// `[THINK]...[/THINK]`) read apart into `reasoning_content`.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ReasoningParser {
    /// `mistral` when the chat template mentions `[THINK]` (Magistral), `think` when it
    /// mentions `<think>` (Qwen3, SmolLM3, QwQ, DeepSeek-R1), else `none`.
    #[default]
    Auto,
    /// All of the answer is content.
    None,
    /// The `<think>` block (opened by the model, or by the template's generation prompt) is
    /// the reasoning.
    Think,
    /// Mistral's `[THINK]...[/THINK]` block (Magistral) is the reasoning.
    Mistral,
}

choice_from_str!(ReasoningParser { "auto" => Auto, "none" => None, "think" => Think, "mistral" => Mistral });

/// How the paged KV cache stores keys and values.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum KvCacheDtype {
    /// The backend's own: bf16 on the CUDA backend, f16 on the CPU backend.
    #[default]
    Auto,
    /// The CUDA backend stores e4m3 values with an f32 scale per token and KV head (the
    /// vector's max |x| / 448, no calibration): about half the bytes per token, so twice the
    /// cached tokens in the same memory and half the bytes attention reads.
    Fp8,
}

choice_from_str!(KvCacheDtype { "auto" => Auto, "fp8" => Fp8 });

/// Whose requests may share cached prefix blocks.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum PrefixSharing {
    /// Only requests of the same tenant (the API key's): one tenant cannot learn from the
    /// time to first token whether another sent a prompt.
    #[default]
    Tenant,
    /// Every request (one tenant, or tenants who trust each other).
    Global,
}

choice_from_str!(PrefixSharing { "tenant" => Tenant, "global" => Global });

/// The `model:` section.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(
    deny_unknown_fields,
    default,
    expecting = "a mapping (the model section)"
)]
pub struct ModelSection {
    /// A GGUF file or a Hugging Face directory; `~` expands to the home directory. When empty,
    /// the embedded default (SmolLM2-135M-Instruct, fetched by `switchyard model fetch`) is used.
    pub path: String,
    /// The name clients use in the `model` field; defaults to the file's name.
    pub served_name: Option<String>,
    /// Backend selection.
    pub backend: BackendKind,
    /// How weights are loaded: `auto` follows the path; `gguf` or `safetensors` must match
    /// what the path holds (`serve` refuses a mismatch before loading).
    pub load_format: LoadFormat,
    /// Architecture preset of random weights (one of [`DUMMY_ARCHITECTURES`]) for
    /// `load_format: dummy`, which is for benchmarks: `serve` (so the configuration) refuses
    /// both; a model file's architecture is read from the file.
    pub architecture: Option<String>,
    /// Weight quantization applied at load (`none`, `fp8`: CUDA backend only).
    pub quantization: Quantization,
    /// Longest prompt plus output accepted; defaults to the model's context length, and may
    /// not exceed it (`serve` refuses a larger value).
    pub max_model_len: Option<usize>,
    /// A Jinja chat template file used instead of the model's own; `~` expands to the home
    /// directory.
    pub chat_template: Option<String>,
    /// How the model writes tool calls.
    pub tool_call_format: ToolCallFormat,
    /// Who writes tools, calls and results into the prompt.
    pub tool_prompt: ToolPrompt,
    /// Whether the reasoning of chat answers is read apart.
    pub reasoning_parser: ReasoningParser,
    /// CPU threads for the CPU backend (0 = all cores; at most [`MAX_CPU_THREADS`]).
    #[serde(deserialize_with = "usize_in::<_, 0, { MAX_CPU_THREADS as u64 }>")]
    pub threads: usize,
    /// The CPU backend's activation precision (`auto`, `int8`, `mixed`, `precise`).
    pub cpu_precision: CpuPrecision,
    /// How added tokens' text in chat messages is encoded (`text`, `tokens`).
    pub message_special_tokens: MessageSpecialTokens,
}

impl Default for ModelSection {
    fn default() -> Self {
        Self {
            path: String::new(),
            served_name: None,
            backend: BackendKind::Auto,
            load_format: LoadFormat::Auto,
            architecture: None,
            quantization: Quantization::None,
            max_model_len: None,
            chat_template: None,
            tool_call_format: ToolCallFormat::Auto,
            tool_prompt: ToolPrompt::Auto,
            reasoning_parser: ReasoningParser::Auto,
            threads: 0,
            cpu_precision: CpuPrecision::Auto,
            message_special_tokens: MessageSpecialTokens::Text,
        }
    }
}

/// One API key and who it belongs to.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(
    deny_unknown_fields,
    expecting = "a mapping of key, tenant, tier and adapters"
)]
pub struct ApiKeyEntry {
    /// The secret bearer token.
    pub key: String,
    /// Tenant name (bounded label for fair share and metrics).
    pub tenant: String,
    /// Default tier for this tenant's requests.
    #[serde(default)]
    pub tier: Option<String>,
    /// The LoRA adapters the key's requests may name as `model`: names, or name prefixes
    /// ending in `*` (`acme-*`; `*` alone is every adapter), at most
    /// [`MAX_ADAPTER_PATTERNS`]. `None` (the default): every adapter; `[]`: none, the base
    /// model only. Other adapters are `model_not_found` to the key, as if they did not exist.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapters: Option<Vec<String>>,
}

/// Most patterns in an API key's `adapters`.
pub const MAX_ADAPTER_PATTERNS: usize = 256;

/// Checks one pattern of an API key's `adapters`: an adapter name as
/// [`check_adapter_name`] accepts it, or a prefix of one (possibly empty) followed by `*`.
pub fn check_adapter_pattern(pattern: &str) -> Result<(), String> {
    let (prefix, wildcard) = match pattern.strip_suffix('*') {
        Some(prefix) => (prefix, true),
        None => (pattern, false),
    };
    if prefix.contains('*') {
        return Err(format!(
            "`{pattern}`: `*` may only end a pattern (a name prefix: `acme-*`)"
        ));
    }
    if !wildcard {
        return check_adapter_name(pattern);
    }
    if prefix.is_empty() {
        return Ok(());
    }
    // A prefix of a valid name: every character allowed, and not too long for a name to
    // follow it. `.` alone is a valid prefix (of `.x`).
    let probe = format!("{prefix}x");
    check_adapter_name(&probe).map_err(|why| format!("`{pattern}`: {why}"))
}

/// Longest tenant name (the scheduler's label bound).
pub const MAX_TENANT_BYTES: usize = 256;

impl ApiKeyEntry {
    /// Checks the key's length, the tenant name's and that the tier is one of `tiers`: the
    /// field at fault (`key`, `tenant`, `tier`) and why.
    pub fn check<V>(
        &self,
        tiers: &std::collections::BTreeMap<String, V>,
    ) -> Result<(), (&'static str, String)> {
        if self.key.len() < 8 || self.key.len() > 512 {
            return Err(("key", "API keys must be 8-512 bytes".into()));
        }
        if self.tenant.is_empty() || self.tenant.len() > MAX_TENANT_BYTES {
            return Err((
                "tenant",
                format!("tenant names are 1-{MAX_TENANT_BYTES} bytes"),
            ));
        }
        if let Some(t) = &self.tier {
            if !tiers.contains_key(t) {
                return Err(("tier", format!("unknown tier `{t}`")));
            }
        }
        if let Some(patterns) = &self.adapters {
            if patterns.len() > MAX_ADAPTER_PATTERNS {
                return Err((
                    "adapters",
                    format!("at most {MAX_ADAPTER_PATTERNS} patterns"),
                ));
            }
            for p in patterns {
                check_adapter_pattern(p).map_err(|why| ("adapters", why))?;
            }
        }
        Ok(())
    }
}

/// The `server:` section.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(
    deny_unknown_fields,
    default,
    expecting = "a mapping (the server section)"
)]
pub struct ServerSection {
    /// Address to bind.
    pub host: String,
    /// Port to bind (0 picks a free port and logs it).
    #[serde(deserialize_with = "u16_in::<_, 0, 65535>")]
    pub port: u16,
    /// API keys inline; when there are none and `api_keys_file` is unset, no key is required
    /// (an open API, logged as such at start). Each key must be unique.
    pub api_keys: Vec<ApiKeyEntry>,
    /// A YAML file holding a list of API keys (same shape as `api_keys`), read at start; set,
    /// it must hold at least one key. `~` expands to the home directory.
    pub api_keys_file: Option<String>,
    /// Bearer token for /admin routes; admin routes are disabled when unset. It must differ
    /// from every API key.
    pub admin_key: Option<String>,
    /// Largest accepted request body in bytes.
    #[serde(deserialize_with = "usize_in::<_, 1024, 67108864>")]
    pub max_body_bytes: usize,
    /// Requests in flight at once, counted per choice (prompts × `n`: a completion of two
    /// prompts counts two, as one prompt with `n: 2` does); a request that fits but not now
    /// is answered 503 with Retry-After, one with more choices than this is a 400.
    #[serde(deserialize_with = "usize_in::<_, 1, 1000000>")]
    pub max_pending_requests: usize,
    /// Seconds to let in-flight requests finish after SIGTERM.
    #[serde(deserialize_with = "int_in::<_, 0, 3600>")]
    pub drain_timeout_s: u64,
    /// Seconds a client may take to send a request's head, and again its body (else 408).
    #[serde(deserialize_with = "int_in::<_, 1, 3600>")]
    pub request_timeout_s: u64,
    /// HTTP worker threads (0 = one per core).
    #[serde(deserialize_with = "usize_in::<_, 0, 256>")]
    pub workers: usize,
    /// The Responses API's store of responses (`GET /v1/responses/{id}`,
    /// `previous_response_id`).
    pub responses: ResponsesSection,
    /// Serve `POST /v1/embeddings` (the model's final hidden state at each input's last
    /// token, normalized); off, the route answers 404 `embeddings_not_served`.
    pub embeddings: bool,
    /// HTTPS with these certificate and key files; absent, plain HTTP.
    pub tls: Option<crate::TlsSection>,
    /// Which browser origins may call the API; absent, no CORS headers are sent (browsers
    /// refuse cross-origin calls).
    pub cors: Option<crate::CorsSection>,
}

/// `server.responses`: bounds of the store of responses, kept in memory per tenant (and
/// journaled in `path`, when set, to survive a restart); the least recently used response
/// leaves first when a bound would be passed.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(
    deny_unknown_fields,
    default,
    expecting = "a mapping (the server.responses section)"
)]
pub struct ResponsesSection {
    /// Most responses kept (0: none is stored, and `previous_response_id` is refused).
    #[serde(deserialize_with = "usize_in::<_, 0, 1000000>")]
    pub max_stored: usize,
    /// Most MiB the kept responses count (a response counts its object and its whole
    /// conversation's items).
    #[serde(deserialize_with = "usize_in::<_, 1, 65536>")]
    pub max_stored_mb: usize,
    /// Seconds a response is kept after it was stored (0: no age limit).
    #[serde(deserialize_with = "int_in::<_, 0, 31536000>")]
    pub max_age_s: u64,
    /// A directory where the stored responses are journaled, so that they survive a restart
    /// (created if missing; one server at a time); absent, they are kept in memory only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
}

impl Default for ResponsesSection {
    fn default() -> Self {
        Self {
            max_stored: 10_000,
            max_stored_mb: 256,
            max_age_s: 86_400,
            path: None,
        }
    }
}

impl ServerSection {
    /// `host` as the IP address to bind (`::1` or `[::1]` as in a URL); why not, when it is
    /// not one (host names are not resolved).
    pub fn bind_ip(&self) -> Result<std::net::IpAddr, String> {
        self.host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse()
            .map_err(|_| {
                format!(
                    "`{}` is not an IP address (such as 127.0.0.1, 0.0.0.0 or ::1; host names \
                     are not resolved)",
                    self.host
                )
            })
    }
}

impl Default for ServerSection {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8000,
            api_keys: Vec::new(),
            api_keys_file: None,
            admin_key: None,
            max_body_bytes: 4 << 20,
            max_pending_requests: 4096,
            drain_timeout_s: 30,
            request_timeout_s: 10,
            workers: 0,
            responses: ResponsesSection::default(),
            embeddings: true,
            tls: None,
            cors: None,
        }
    }
}

/// The `cache:` section.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(
    deny_unknown_fields,
    default,
    expecting = "a mapping (the cache section)"
)]
pub struct CacheSection {
    /// Tokens per KV block: a power of two in 1..=1024 ([`BLOCK_SIZES`]).
    #[serde(deserialize_with = "block_size")]
    pub block_size: usize,
    /// Number of KV blocks; when unset it follows from `kv_cache_mb` (CPU) or
    /// `gpu_memory_utilization` (CUDA).
    pub num_blocks: Option<usize>,
    /// KV cache size in MiB for the CPU backend.
    #[serde(deserialize_with = "usize_in::<_, 1, 1048576>")]
    pub kv_cache_mb: usize,
    /// Fraction of GPU memory the CUDA backend may use for weights, activations and KV.
    #[serde(deserialize_with = "fraction")]
    pub gpu_memory_utilization: f64,
    /// Reuse KV blocks of identical prefixes across requests.
    pub prefix_caching: bool,
    /// Whose requests share cached prefixes (a request's `cache_salt` narrows it further).
    pub prefix_sharing: PrefixSharing,
    /// How keys and values are stored: `auto` (the backend's own) or `fp8` (CUDA backend
    /// only).
    pub kv_cache_dtype: KvCacheDtype,
    /// GiB of host memory for a second tier of the prefix cache (vLLM's
    /// `kv_offloading_size`): full cached blocks evicted from the KV cache are copied there,
    /// and a prefix found there is copied back instead of recomputed. 0 (the default): off.
    #[serde(deserialize_with = "offloading_gib")]
    pub kv_offloading_size: f64,
    /// With a host tier: copy cached blocks there once computed (registered in the prefix
    /// cache), ahead of their eviction (on a copy stream of its own on the CUDA backend,
    /// alongside the next step), so that evicting them copies nothing; off: copy each when the
    /// KV cache evicts it, on the step that evicts it.
    pub kv_offloading_ahead: bool,
}

impl CacheSection {
    /// Bytes of host memory `kv_offloading_size` asks for (0: no host tier).
    pub fn kv_offloading_bytes(&self) -> usize {
        (self.kv_offloading_size * f64::from(1u32 << 30)) as usize
    }
}

impl Default for CacheSection {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_blocks: None,
            kv_cache_mb: 512,
            gpu_memory_utilization: 0.9,
            prefix_caching: true,
            prefix_sharing: PrefixSharing::Tenant,
            kv_cache_dtype: KvCacheDtype::Auto,
            kv_offloading_size: 0.0,
            kv_offloading_ahead: true,
        }
    }
}

/// A policy by registered name, with its parameters.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
// The expectation says how to set the name alone: `--set scheduler.policy=fcfs` is the
// likely first try, and "a mapping" did not say which key takes the name.
#[serde(
    deny_unknown_fields,
    expecting = "a mapping of name and params, as `{ name: fcfs }` \
                 (`--set scheduler.policy.name=fcfs` sets the name alone)"
)]
pub struct PolicySpec {
    /// Registered policy name (`fcfs`, `priority`, `slo-aware`, `chunked-prefill`, `fair-share`,
    /// `prefix-aware`).
    pub name: String,
    /// Policy parameters; each policy validates its own.
    #[serde(default)]
    pub params: serde_yaml::Value,
}

impl Default for PolicySpec {
    fn default() -> Self {
        Self {
            name: "fcfs".into(),
            params: serde_yaml::Value::Null,
        }
    }
}

impl PolicySpec {
    /// Whether `other` names the same policy with the same parameters, no parameters and an
    /// empty mapping alike: as the server compares a reloaded or `PUT /admin/policy` policy
    /// with the one in force, which it then leaves running (a swap would reset its state).
    pub fn same_policy(&self, other: &PolicySpec) -> bool {
        fn params(v: &serde_yaml::Value) -> Option<&serde_yaml::Value> {
            match v {
                serde_yaml::Value::Null => None,
                serde_yaml::Value::Mapping(m) if m.is_empty() => None,
                v => Some(v),
            }
        }
        self.name == other.name && params(&self.params) == params(&other.params)
    }
}

/// Most sequences in one step (`scheduler.max_num_seqs`): the rows a backend samples in one
/// step. The simulator's spec shares the bound, so it cannot model a server that cannot run.
pub const MAX_NUM_SEQS: usize = 2048;
/// Most tokens in one step (`scheduler.max_num_batched_tokens`); shared with the simulator.
pub const MAX_NUM_BATCHED_TOKENS: usize = 1 << 20;
/// Most tokens in one step on the CUDA backend, which sizes its buffers and kernel launches for
/// at most this many (the CPU backend takes [`MAX_NUM_BATCHED_TOKENS`]): checked by
/// [`Config::validate`] with `model.backend: cuda`, and when `auto` picks a GPU.
pub const CUDA_MAX_NUM_BATCHED_TOKENS: usize = 1 << 16;

/// The `scheduler:` section.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(
    deny_unknown_fields,
    default,
    expecting = "a mapping (the scheduler section)"
)]
pub struct SchedulerSection {
    /// Most sequences in one step (at most [`MAX_NUM_SEQS`], 2048: the rows a backend samples
    /// in one step).
    #[serde(deserialize_with = "usize_in::<_, 1, { MAX_NUM_SEQS as u64 }>")]
    pub max_num_seqs: usize,
    /// Most tokens (prefill chunks plus decodes) in one step (at most
    /// [`MAX_NUM_BATCHED_TOKENS`]).
    #[serde(deserialize_with = "usize_in::<_, 1, { MAX_NUM_BATCHED_TOKENS as u64 }>")]
    pub max_num_batched_tokens: usize,
    /// The scheduling policy.
    pub policy: PolicySpec,
    /// Plan and submit each step while the previous one runs on the device: `auto` (on
    /// with the CUDA backend), `on` or `off`. Outputs are then applied one step late, and a
    /// request that stops costs one extra step of compute.
    pub async_scheduling: AsyncSchedulingMode,
    /// Longest a request may wait in the queue for its first admission, in milliseconds (1
    /// to 3,600,000), for requests whose tier sets no `max_queue_ms` (an open API, keys
    /// without a configured tier included); past it the request fails with 503
    /// `queue_timeout`. `None` (the default): no bound.
    #[serde(deserialize_with = "opt_u64_in::<_, 1, 3600000>")]
    pub max_queue_ms: Option<u64>,
    /// Longest one backend call (a step, or its submit or collect half, a KV copy) may run,
    /// in seconds (0 to [`MAX_STEP_TIMEOUT_S`], 86,400; 0: no limit), before the engine counts
    /// as stalled: `/health` and `/ready` answer 503 `engine_stalled` and new requests are
    /// refused until the call returns, so that a liveness probe restarts a server whose
    /// device hung. Unset (the default): [`DEFAULT_STEP_TIMEOUT_S`] (300, SGLang's
    /// `--watchdog-timeout`) on a device backend (CUDA), far above any step that works, the
    /// first ones included (which compile the kernels and capture graphs); none on the CPU
    /// backend, which has no device to hang and whose steps take what the model and the batch
    /// make them (a prefill chunk of 8,192 tokens of a 1B model on two cores runs for minutes).
    /// A SIGHUP applies a new value, to the call under way too.
    #[serde(deserialize_with = "opt_u64_in::<_, 0, { MAX_STEP_TIMEOUT_S }>")]
    pub step_timeout_s: Option<u64>,
}

/// The limit on one backend call of a device backend when `scheduler.step_timeout_s` is
/// unset, in seconds.
pub const DEFAULT_STEP_TIMEOUT_S: u64 = 300;
/// The largest `scheduler.step_timeout_s`, in seconds (a day).
pub const MAX_STEP_TIMEOUT_S: u64 = 86_400;

impl SchedulerSection {
    /// The limit on one backend call (`None`: none): `step_timeout_s` when set (0: none),
    /// else [`DEFAULT_STEP_TIMEOUT_S`] for a backend whose steps run on a device (`device`)
    /// and none for one that runs them on the host.
    pub fn step_timeout(&self, device: bool) -> Option<std::time::Duration> {
        let secs = match self.step_timeout_s {
            Some(secs) => secs,
            None if device => DEFAULT_STEP_TIMEOUT_S,
            None => 0,
        };
        (secs > 0).then(|| std::time::Duration::from_secs(secs))
    }
}

impl Default for SchedulerSection {
    fn default() -> Self {
        Self {
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            policy: PolicySpec::default(),
            async_scheduling: AsyncSchedulingMode::Auto,
            max_queue_ms: None,
            step_timeout_s: None,
        }
    }
}

/// One SLO tier.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(
    deny_unknown_fields,
    expecting = "a mapping (a tier: ttft_ms, tpot_ms, weight, preemptible, priority, \
                 max_pending_requests, max_pending_per_tenant, requests_per_minute, \
                 tokens_per_minute, max_queue_ms, max_kv_fraction, max_cpu_loras_per_tenant)"
)]
pub struct TierConfig {
    /// Time-to-first-token target in milliseconds.
    #[serde(default, deserialize_with = "opt_positive_ms")]
    pub ttft_ms: Option<f64>,
    /// Time-per-output-token target in milliseconds.
    #[serde(default, deserialize_with = "opt_positive_ms")]
    pub tpot_ms: Option<f64>,
    /// Share weight for fair scheduling (`fair-share`: a request weighs its tenant's weight
    /// times its tier's), 0.001 to 1e6.
    #[serde(default = "one", deserialize_with = "weight")]
    pub weight: f64,
    /// Whether running requests of this tier may be preempted for other tiers.
    #[serde(default)]
    pub preemptible: bool,
    /// Scheduling priority of the tier's requests (vLLM's: lower is served first; the
    /// `priority` policy reads it), default 0. It is also the most urgent they may ask to be:
    /// a request's own `priority` counts only where it is larger (later), so no key's clients
    /// can jump ahead of a more urgent tier.
    #[serde(default)]
    pub priority: i32,
    /// Most requests of this tier in flight at once (queued, running, or still being
    /// tokenized), counted per choice as `server.max_pending_requests` counts them, 1 to
    /// `server.max_pending_requests`; beyond it the tier's requests are refused with 503
    /// `overloaded` even while the server has room (a request with more choices than this:
    /// a 400). `None` (the default):
    /// only the server's bound applies. The server's bound stays the absolute one, so the
    /// tiers that may flood should have limits that add up to less than it, leaving the rest
    /// to the other tiers.
    #[serde(default, deserialize_with = "opt_usize_in::<_, 1, 1000000>")]
    pub max_pending_requests: Option<usize>,
    /// Most requests each tenant of this tier may have in flight at once, counted per choice
    /// as `max_pending_requests` counts them, 1 to `server.max_pending_requests` (and at most
    /// the tier's own `max_pending_requests`, which it could never reach): beyond it
    /// that tenant's requests are refused with 429 `rate_limit_exceeded` (`Retry-After: 1`)
    /// while the tier's other tenants are admitted, so one tenant's flood cannot take the
    /// tier's `max_pending_requests` (a request with more choices than this: a 400). An open
    /// API is one tenant. `None` (the default): no such bound.
    #[serde(default, deserialize_with = "opt_usize_in::<_, 1, 1000000>")]
    pub max_pending_per_tenant: Option<usize>,
    /// Requests per minute each tenant of this tier may make on the generation routes
    /// (completions, chat, responses, embeddings), 1 to 1e9; beyond it a 429
    /// `rate_limit_exceeded`. A bucket of a minute's requests that refills continuously.
    /// `None` (the default): no such limit.
    #[serde(default, deserialize_with = "opt_u64_in::<_, 1, 1000000000>")]
    pub requests_per_minute: Option<u64>,
    /// Tokens per minute (prompt and generated, as `usage` counts them) each tenant of this
    /// tier may use, 1 to 1e12: a request is admitted while the tenant's budget is not spent
    /// and its tokens are taken as they are used (see the API crate's `rate_limit`).
    /// `None` (the default): no such limit.
    #[serde(default, deserialize_with = "opt_u64_in::<_, 1, 1000000000000>")]
    pub tokens_per_minute: Option<u64>,
    /// Longest a request of this tier may wait in the queue for its first admission, in
    /// milliseconds (1 to 3,600,000); past it the request fails with 503 `queue_timeout`
    /// (load shedding: its client has likely given up). A request admitted once, preempted
    /// later or not, never times out. `None` (the default): `scheduler.max_queue_ms`.
    #[serde(default, deserialize_with = "opt_u64_in::<_, 1, 3600000>")]
    pub max_queue_ms: Option<u64>,
    /// Most of the KV cache the tier's running requests may hold at once, as a fraction of its
    /// blocks in (0, 1] (rounded down, at least one block; a block shared through the prefix
    /// cache counts for each request holding it), so that one tier's long requests cannot
    /// fill the cache: a request beyond it waits while other tiers' requests are admitted, and
    /// a running request that needs a block beyond it preempts its own tier's lowest-ranked
    /// request. A request the bound could never hold is refused with 400
    /// `context_length_exceeded`. `None` (the default): only the whole cache bounds the tier.
    #[serde(
        default,
        deserialize_with = "opt_fraction",
        skip_serializing_if = "Option::is_none"
    )]
    pub max_kv_fraction: Option<f64>,
    /// Most LoRA adapters each tenant of this tier may have loaded into adapter memory and
    /// kept there at once (its share of `lora.max_cpu_loras`), 1 to `lora.max_cpu_loras`: an
    /// adapter in memory is charged to the tenant whose request read it from disk, and once a
    /// tenant's loads fill its share, its next load drops its own least recently used adapter
    /// that no request uses (never another tenant's); when every one of them is in use, the
    /// request is refused with 429 `rate_limit_exceeded` (`Retry-After: 1`). So one tenant
    /// naming many adapters displaces at most this many of the others'. Adapters an operator
    /// loaded (`lora.adapters`, the admin API) and pinned ones are charged to no tenant, and
    /// an adapter in memory serves every key that may name it, whoever it is charged to.
    /// `None` (the default): no share; a tenant's loads may evict any adapter no request uses.
    #[serde(
        default,
        deserialize_with = "opt_usize_in::<_, 1, 4096>",
        skip_serializing_if = "Option::is_none"
    )]
    pub max_cpu_loras_per_tenant: Option<usize>,
}

fn one() -> f64 {
    1.0
}

/// Log output format.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// The `logging:` section.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(
    deny_unknown_fields,
    default,
    expecting = "a mapping (the logging section)"
)]
pub struct LoggingSection {
    /// A tracing filter such as `info` or `switchyard=debug,info`: comma-separated
    /// directives, each a level (trace, debug, info, warn, error, off) or `target=level`.
    pub level: String,
    /// Output format.
    pub format: LogFormat,
}

impl Default for LoggingSection {
    fn default() -> Self {
        Self {
            level: "info".into(),
            format: LogFormat::Text,
        }
    }
}

/// The `lora:` section: adapters served on top of the base model, chosen per request by
/// `model: <adapter name>`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(
    deny_unknown_fields,
    default,
    expecting = "a mapping (the lora section)"
)]
pub struct LoraSection {
    /// Serve LoRA adapters.
    pub enabled: bool,
    /// Most distinct adapters among the running requests (so in one step); requests for
    /// further adapters wait.
    #[serde(deserialize_with = "usize_in::<_, 1, 1024>")]
    pub max_loras: usize,
    /// Largest adapter rank accepted.
    #[serde(deserialize_with = "usize_in::<_, 1, 1024>")]
    pub max_lora_rank: usize,
    /// Most adapters registered at once (from this file and the admin API together).
    #[serde(deserialize_with = "usize_in::<_, 1, 4096>")]
    pub max_adapters: usize,
    /// Most adapters kept in memory, those in use included: beyond it, the least recently
    /// used adapter no request uses is dropped and reloaded from disk on its next request;
    /// adapters in use are never dropped, so while more than this many are in use, all stay.
    #[serde(deserialize_with = "usize_in::<_, 0, 4096>")]
    pub max_cpu_loras: usize,
    /// Adapters registered at start.
    pub adapters: Vec<LoraAdapterEntry>,
    /// Directories of adapters served on demand (vLLM's filesystem LoRA resolver): a request
    /// naming an adapter that is not registered is served the adapter in `<dir>/<name>/` of
    /// the first directory that has one (`adapter_config.json` there), registered on that
    /// first request. At most [`MAX_ADAPTER_DIRS`]; `~/` expands.
    pub adapter_dirs: Vec<String>,
}

/// Most entries of `lora.adapter_dirs`.
pub const MAX_ADAPTER_DIRS: usize = 16;

impl Default for LoraSection {
    fn default() -> Self {
        Self {
            enabled: false,
            max_loras: 4,
            max_lora_rank: 64,
            max_adapters: 64,
            max_cpu_loras: 8,
            adapters: Vec::new(),
            adapter_dirs: Vec::new(),
        }
    }
}

/// One adapter of `lora.adapters`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, expecting = "a mapping of name, path and pinned")]
pub struct LoraAdapterEntry {
    /// The name requests use as `model`.
    pub name: String,
    /// The PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`);
    /// relative paths are taken from the server's working directory, `~/` is expanded.
    pub path: String,
    /// Kept in memory while served, never evicted to make room for another adapter (at most
    /// `max_cpu_loras` adapters are pinned): its requests never wait for its files to load.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pinned: bool,
}

/// The architecture presets of random (dummy) weights, as `switchyard bench throughput --dummy`
/// names them (`runtime::preset` in the binary builds each).
pub const DUMMY_ARCHITECTURES: [&str; 6] = [
    "smollm2-135m",
    "llama-3-8b",
    "qwen2.5-0.5b",
    "qwen3-0.6b",
    "phi-3-mini",
    "mistral-7b-v0.1",
];

/// Longest LoRA adapter name, in characters.
pub const MAX_ADAPTER_NAME: usize = 128;

/// Checks a LoRA adapter's name, the one check of `lora.adapters` names and of names loaded
/// through the admin API: the name is a request's `model` and one segment of
/// `DELETE /admin/lora/{name}`, so it is 1 to [`MAX_ADAPTER_NAME`] characters that need no
/// escaping in a URL path and that no client normalises away: ASCII letters, digits and
/// `.` `_` `-` `:` `@` `+`, and not `.` or `..` (which clients resolve as path steps). `/` is
/// left out: the route's segment cannot hold it unescaped. The reason is for the message.
pub fn check_adapter_name(name: &str) -> Result<(), String> {
    const ALLOWED: &str = "ASCII letters, digits and . _ - : @ +";
    if name.is_empty() || name.len() > MAX_ADAPTER_NAME {
        return Err(format!(
            "an adapter name has 1 to {MAX_ADAPTER_NAME} characters ({ALLOWED})"
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|&c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':' | '@' | '+')))
    {
        return Err(format!(
            "{c:?} is not allowed in an adapter name (only {ALLOWED}: the name is a URL path \
             segment and a `model` value)"
        ));
    }
    if name == "." || name == ".." {
        return Err(format!(
            "`{name}` is not an adapter name: clients resolve it as a path step"
        ));
    }
    Ok(())
}

/// Most tiers a configuration may declare (tier names become metric labels).
pub const MAX_TIERS: usize = 32;

impl Config {
    /// Refuses the settings of one backend given with the other named in `model.backend`,
    /// as the backend refuses them once the model has loaded: `cpu_precision` on `cuda`,
    /// `quantization: fp8` and `kv_cache_dtype: fp8` on `cpu`. `auto` is checked once it
    /// picks (a GPU ignores `cpu_precision` with a warning).
    fn check_backend_only_fields(&self) -> Result<(), (String, String)> {
        let refuse = |field: &str, why: &str| Err((field.to_string(), why.to_string()));
        match self.model.backend {
            BackendKind::Cuda if self.model.cpu_precision != CpuPrecision::Auto => refuse(
                "model.cpu_precision",
                &format!(
                    "{} applies to the CPU backend only (model.backend: cuda computes in \
                     bf16): leave it at auto",
                    format!("{:?}", self.model.cpu_precision).to_lowercase()
                ),
            ),
            BackendKind::Cpu if self.model.quantization == Quantization::Fp8 => refuse(
                "model.quantization",
                "fp8 runs on the CUDA backend only (model.backend: cpu runs a GGUF's own \
                 quantized types)",
            ),
            BackendKind::Cpu if self.cache.kv_cache_dtype == KvCacheDtype::Fp8 => refuse(
                "cache.kv_cache_dtype",
                "fp8 runs on the CUDA backend only (model.backend: cpu keeps its cache in f16)",
            ),
            _ => Ok(()),
        }
    }

    /// Checks rules that span fields; returns the dotted field path and a message.
    pub fn validate(&self) -> Result<(), (String, String)> {
        if let Some(spec) = &self.speculative {
            if spec.prompt_lookup_min > spec.prompt_lookup_max {
                return Err((
                    "speculative.prompt_lookup_min".into(),
                    format!(
                        "{} exceeds prompt_lookup_max ({})",
                        spec.prompt_lookup_min, spec.prompt_lookup_max
                    ),
                ));
            }
        }
        if self.tiers.len() > MAX_TIERS {
            return Err((
                "tiers".into(),
                format!("at most {MAX_TIERS} tiers are allowed"),
            ));
        }
        // The parser checks each name at its key (`deserialize_tiers`); this holds for a
        // configuration built in code too.
        for name in self.tiers.keys() {
            crate::check_tier_name(name).map_err(|why| ("tiers".to_string(), why))?;
        }
        for (name, tier) in &self.tiers {
            for (field, bound) in [
                ("max_pending_requests", tier.max_pending_requests),
                ("max_pending_per_tenant", tier.max_pending_per_tenant),
            ] {
                match bound {
                    Some(n) if n > self.server.max_pending_requests => {
                        return Err((
                            format!("tiers.{name}.{field}"),
                            format!(
                                "{n} exceeds server.max_pending_requests ({}), the bound on \
                                 every tier together",
                                self.server.max_pending_requests
                            ),
                        ));
                    }
                    _ => {}
                }
            }
            match tier.max_cpu_loras_per_tenant {
                Some(n) if n > self.lora.max_cpu_loras => {
                    return Err((
                        format!("tiers.{name}.max_cpu_loras_per_tenant"),
                        format!(
                            "{n} exceeds lora.max_cpu_loras ({}), the adapters kept in memory \
                             for every tenant together",
                            self.lora.max_cpu_loras
                        ),
                    ));
                }
                _ => {}
            }
            if let (Some(per_tenant), Some(tier_bound)) =
                (tier.max_pending_per_tenant, tier.max_pending_requests)
            {
                if per_tenant > tier_bound {
                    return Err((
                        format!("tiers.{name}.max_pending_per_tenant"),
                        format!(
                            "{per_tenant} exceeds tiers.{name}.max_pending_requests \
                             ({tier_bound}): no tenant could ever reach it"
                        ),
                    ));
                }
            }
        }
        for (i, k) in self.server.api_keys.iter().enumerate() {
            k.check(&self.tiers)
                .map_err(|(field, why)| (format!("server.api_keys[{i}].{field}"), why))?;
        }
        crate::keys::check_inline(self)?;
        if let Some(tls) = &self.server.tls {
            tls.check()?;
        }
        if let Some(cors) = &self.server.cors {
            cors.check()?;
        }
        if let Some(k) = &self.server.admin_key {
            if k.len() < 8 || k.len() > 512 {
                return Err((
                    "server.admin_key".into(),
                    "the admin key must be 8-512 bytes".into(),
                ));
            }
        }
        if let Some(n) = self.cache.num_blocks {
            if n == 0 || n > MAX_NUM_BLOCKS {
                return Err((
                    "cache.num_blocks".into(),
                    format!("{n} is out of range 1..={MAX_NUM_BLOCKS}"),
                ));
            }
        }
        if self.cache.kv_offloading_size > 0.0 && !self.cache.prefix_caching {
            return Err((
                "cache.kv_offloading_size".into(),
                "the host KV tier keeps blocks of the prefix cache: it needs \
                 cache.prefix_caching: true (or kv_offloading_size: 0)"
                    .into(),
            ));
        }
        if let Some(n) = self.model.max_model_len {
            if n == 0 || n > 1 << 22 {
                return Err((
                    "model.max_model_len".into(),
                    format!("{n} is out of range 1..=4194304"),
                ));
            }
        }
        // What `serve` refuses before loading the model, refused here too so that `config
        // check` (and a SIGHUP reload) refuse it as well.
        if self.model.load_format == LoadFormat::Dummy {
            return Err((
                "model.load_format".into(),
                format!(
                    "dummy is for benchmarks (`switchyard bench throughput --dummy ARCH`, ARCH \
                     one of {}); serve needs real weights",
                    DUMMY_ARCHITECTURES.join(", ")
                ),
            ));
        }
        // The architecture of real weights comes from their files: a preset set beside them
        // would be ignored, so it is refused rather than let the operator believe it applies.
        if let Some(a) = &self.model.architecture {
            return Err((
                "model.architecture".into(),
                format!(
                    "`{a}` is only used with load_format: dummy (random weights); the \
                     architecture of a model file is read from the file, so remove this field"
                ),
            ));
        }
        self.server
            .bind_ip()
            .map_err(|why| ("server.host".to_string(), why))?;
        crate::log_filter::check_log_filter(&self.logging.level)
            .map_err(|why| ("logging.level".to_string(), why))?;
        if self.scheduler.max_num_batched_tokens < self.scheduler.max_num_seqs {
            return Err((
                "scheduler.max_num_batched_tokens".into(),
                format!(
                    "{} must be at least max_num_seqs ({})",
                    self.scheduler.max_num_batched_tokens, self.scheduler.max_num_seqs
                ),
            ));
        }
        // Only where the backend is known to be CUDA: `auto` may pick the CPU, which takes
        // more, and is checked once it picks a GPU.
        if self.model.backend == BackendKind::Cuda
            && self.scheduler.max_num_batched_tokens > CUDA_MAX_NUM_BATCHED_TOKENS
        {
            return Err((
                "scheduler.max_num_batched_tokens".into(),
                format!(
                    "{} is more than the CUDA backend (model.backend: cuda) runs in one step, \
                     at most {CUDA_MAX_NUM_BATCHED_TOKENS}",
                    self.scheduler.max_num_batched_tokens
                ),
            ));
        }
        self.check_backend_only_fields()?;
        if !self.lora.adapters.is_empty() && !self.lora.enabled {
            return Err((
                "lora.adapters".into(),
                "adapters are listed but lora.enabled is false".into(),
            ));
        }
        if !self.lora.adapter_dirs.is_empty() && !self.lora.enabled {
            return Err((
                "lora.adapter_dirs".into(),
                "adapter directories are listed but lora.enabled is false".into(),
            ));
        }
        if self.lora.adapter_dirs.len() > MAX_ADAPTER_DIRS {
            return Err((
                "lora.adapter_dirs".into(),
                format!("at most {MAX_ADAPTER_DIRS} directories"),
            ));
        }
        for (i, d) in self.lora.adapter_dirs.iter().enumerate() {
            if d.is_empty() || d.len() > 4096 {
                return Err((
                    format!("lora.adapter_dirs[{i}]"),
                    "paths are 1-4096 bytes".into(),
                ));
            }
        }
        if self.lora.adapters.len() > self.lora.max_adapters {
            return Err((
                "lora.adapters".into(),
                format!(
                    "{} adapters exceed lora.max_adapters ({})",
                    self.lora.adapters.len(),
                    self.lora.max_adapters
                ),
            ));
        }
        for (i, a) in self.lora.adapters.iter().enumerate() {
            if let Err(reason) = check_adapter_name(&a.name) {
                return Err((format!("lora.adapters[{i}].name"), reason));
            }
            if self.lora.adapters[..i].iter().any(|b| b.name == a.name) {
                return Err((
                    format!("lora.adapters[{i}].name"),
                    format!("`{}` is listed twice", a.name),
                ));
            }
            if a.path.is_empty() || a.path.len() > 4096 {
                return Err((
                    format!("lora.adapters[{i}].path"),
                    "paths are 1-4096 bytes".into(),
                ));
            }
            let pinned_before = self.lora.adapters[..i].iter().filter(|b| b.pinned).count();
            if a.pinned && pinned_before >= self.lora.max_cpu_loras {
                return Err((
                    format!("lora.adapters[{i}].pinned"),
                    format!(
                        "at most lora.max_cpu_loras ({}) adapters may be pinned in memory",
                        self.lora.max_cpu_loras
                    ),
                ));
            }
        }
        if self.scheduler.policy.name.is_empty() {
            return Err((
                "scheduler.policy.name".into(),
                "a policy name is required".into(),
            ));
        }
        Ok(())
    }

    /// Tiers in name order as (name, config) pairs.
    pub fn tier_list(&self) -> Vec<(String, TierConfig)> {
        self.tiers
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }
}

#[cfg(test)]
mod policy_spec_tests {
    use super::PolicySpec;

    fn spec(yaml: &str) -> PolicySpec {
        serde_yaml::from_str(yaml).unwrap()
    }

    #[test]
    fn same_policy_takes_no_params_and_empty_params_alike() {
        let cases = [
            ("{name: fcfs}", "{name: fcfs, params: {}}", true),
            ("{name: fcfs}", "{name: priority}", false),
            (
                "{name: priority, params: {aging_interval_ms: 100}}",
                "{name: priority, params: {aging_interval_ms: 100}}",
                true,
            ),
            (
                "{name: priority, params: {aging_interval_ms: 100}}",
                "{name: priority, params: {aging_interval_ms: 200}}",
                false,
            ),
            (
                "{name: priority}",
                "{name: priority, params: {aging_interval_ms: 100}}",
                false,
            ),
        ];
        for (a, b, same) in cases {
            assert_eq!(spec(a).same_policy(&spec(b)), same, "{a} vs {b}");
            assert_eq!(spec(b).same_policy(&spec(a)), same, "{b} vs {a}");
        }
    }
}
