//! `load_model`: a GGUF file or a Hugging Face checkpoint directory turned into a
//! [`LoadedModel`] (configuration, memory-mapped weights checked against the configuration,
//! tokenizer, chat template).

use std::path::Path;

use super::chat_template::ChatTemplate;
use super::config::{LlamaConfig, MAX_EOS_IDS};
use super::gguf::GgufFile;
use super::read_bounded;
use super::rope;
use super::safetensors_dir::load_safetensors_dir;
use super::tensor::ModelWeights;
use super::tokenizer::Tokenizer;
use crate::error::GpuError;
use crate::progress::ProgressSink;

/// Largest `config.json` accepted, in bytes.
const MAX_CONFIG_JSON: u64 = 16 << 20;

/// A model ready for a backend.
#[derive(Debug)]
pub struct LoadedModel {
    /// Architecture hyper-parameters.
    pub config: LlamaConfig,
    /// All tensors under canonical GGUF names.
    pub weights: ModelWeights,
    /// The model's tokenizer.
    pub tokenizer: Tokenizer,
    /// The model's chat template, if it ships one.
    pub chat_template: Option<ChatTemplate>,
    /// A human-readable model name (GGUF `general.name`, or the file or directory name).
    pub name: String,
}

/// Loads a `.gguf` file, a directory holding exactly one `.gguf` file and no `config.json`
/// (such as a `model fetch` cache directory), or a Hugging Face directory (`config.json`,
/// `*.safetensors`, `tokenizer.json`, optionally `tokenizer_config.json` /
/// `chat_template.jinja`). `progress` follows the checks of the tensors (`loading model`,
/// counted in tensors).
pub fn load_model(path: &Path, progress: &dyn ProgressSink) -> Result<LoadedModel, GpuError> {
    let model = if path.is_dir() {
        match single_gguf_in(path)? {
            Some(file) => load_gguf(&file)?,
            None => load_hf_dir(path)?,
        }
    } else {
        load_gguf(path)?
    };
    let mut model = model;
    unfuse(&model.config, &mut model.weights)?;
    move_unrotated_dims(&model.config, &mut model.weights)?;
    validate_weights(&model.config, &model.weights, progress)?;
    if model.tokenizer.vocab_size() > model.config.vocab_size {
        return Err(GpuError::InvalidConfig(format!(
            "tokenizer has {} tokens but the embedding only {} rows",
            model.tokenizer.vocab_size(),
            model.config.vocab_size
        )));
    }
    Ok(model)
}

/// Splits fused projections into the ones the backends use (views of the same bytes): Phi-3's
/// `attn_qkv` (Q, K and V rows) and its `ffn_up` of twice the FFN's rows (gate, then up), as
/// transformers' `Phi3` and llama.cpp read them.
fn unfuse(c: &LlamaConfig, weights: &mut ModelWeights) -> Result<(), GpuError> {
    let (q, kv, ff) = (
        c.num_heads * c.head_dim,
        c.num_kv_heads * c.head_dim,
        c.intermediate_size,
    );
    for i in 0..c.num_layers {
        let name = |n: &str| format!("blk.{i}.{n}.weight");
        if weights.contains(&name("attn_qkv")) {
            weights.split_rows(
                &name("attn_qkv"),
                &[
                    (name("attn_q"), q),
                    (name("attn_k"), kv),
                    (name("attn_v"), kv),
                ],
            )?;
        }
        let up = name("ffn_up");
        let fused_up = !weights.contains(&name("ffn_gate"))
            && weights
                .get(&up)
                .is_ok_and(|t| t.shape.first() == Some(&(2 * ff)));
        if fused_up {
            weights.split_rows(&up, &[(name("ffn_gate"), ff), (up.clone(), ff)])?;
        }
    }
    Ok(())
}

/// The order of one query or key head's dimensions for a partial rotary embedding of
/// `rotary` of `head_dim` dimensions: entry `i` is the model's dimension that goes to `i`. The
/// model rotates the pairs `(j, j + rotary / 2)` and leaves the dimensions from `rotary` on as
/// they are; in the new order the rotated pairs are the first `rotary / 2` of the usual halves'
/// pairs `(i, i + head_dim / 2)`, and the unrotated dimensions fill the rest of each half, so
/// a backend rotates every pair of the halves, the last ones at frequency 0. A query's and a
/// key's dimensions move alike, so their dot products, and attention, are the model's.
pub(crate) fn partial_rotary_order(head_dim: usize, rotary: usize) -> Vec<usize> {
    let (half, r2, rest) = (head_dim / 2, rotary / 2, (head_dim - rotary) / 2);
    let mut order = vec![0; head_dim];
    for j in 0..r2 {
        order[j] = j;
        order[half + j] = r2 + j;
    }
    for m in 0..rest {
        order[r2 + m] = rotary + m;
        order[half + r2 + m] = rotary + rest + m;
    }
    order
}

/// Reorders each query and key head's rows by [`partial_rotary_order`] for a model that
/// rotates only part of each head (`LlamaConfig::rotary_dim`; the config refuses Q and K
/// biases or norms with it, which would need the same order).
fn move_unrotated_dims(c: &LlamaConfig, weights: &mut ModelWeights) -> Result<(), GpuError> {
    if c.rotary_dim >= c.head_dim {
        return Ok(());
    }
    let head = partial_rotary_order(c.head_dim, c.rotary_dim);
    let rows = |heads: usize| -> Vec<usize> {
        (0..heads)
            .flat_map(|h| head.iter().map(move |&d| h * c.head_dim + d))
            .collect()
    };
    let (q, k) = (rows(c.num_heads), rows(c.num_kv_heads));
    for i in 0..c.num_layers {
        weights.permute_rows(&format!("blk.{i}.attn_q.weight"), &q)?;
        weights.permute_rows(&format!("blk.{i}.attn_k.weight"), &k)?;
    }
    Ok(())
}

/// Checks that `path` is what [`load_model`] reads, without loading it (a few bytes read, for
/// `config check` and `serve` before the load): a GGUF file (its first four bytes are GGUF's
/// magic), a directory holding one `.gguf` file (the same, of that file), or a Hugging Face
/// checkpoint directory, whose `config.json` and `tokenizer.json` are regular files and whose
/// safetensors shards are found as the load finds them (`model.safetensors.index.json`, else
/// every `*.safetensors`). Any other directory is refused saying what a model is. Passing it
/// promises no load: the files' contents are checked as the model loads.
pub fn check_model_path(path: &Path) -> Result<(), GpuError> {
    if !path.is_dir() {
        return check_gguf_magic(path);
    }
    if let Some(file) = single_gguf_in(path)? {
        return check_gguf_magic(&file);
    }
    if !is_hf_checkpoint(path) {
        return Err(GpuError::invalid_file(
            path,
            "a directory with neither a .gguf file nor config.json: a model is a GGUF file, a \
             directory holding one, or a Hugging Face checkpoint (config.json, tokenizer.json \
             and *.safetensors)",
        ));
    }
    for name in ["config.json", "tokenizer.json"] {
        super::open_regular(&path.join(name))?;
    }
    super::safetensors_dir::shard_files(path).map(drop)
}

/// Refuses a file that does not start with GGUF's magic, reading those four bytes only.
fn check_gguf_magic(path: &Path) -> Result<(), GpuError> {
    use std::io::Read;
    let mut magic = Vec::with_capacity(4);
    super::open_regular(path)?
        .take(4)
        .read_to_end(&mut magic)
        .map_err(|e| GpuError::io(path, e))?;
    if magic != super::gguf::GGUF_MAGIC {
        return Err(GpuError::invalid_file(path, "not a GGUF file (bad magic)"));
    }
    Ok(())
}

/// Whether [`load_model`] reads `path` as a Hugging Face checkpoint (a directory with
/// `config.json`); any other directory holds one GGUF file, and a file is GGUF.
pub fn is_hf_checkpoint(path: &Path) -> bool {
    path.is_dir() && path.join("config.json").exists()
}

/// The only `.gguf` file in `dir` when it is not a Hugging Face checkpoint.
fn single_gguf_in(dir: &Path) -> Result<Option<std::path::PathBuf>, GpuError> {
    if is_hf_checkpoint(dir) {
        return Ok(None);
    }
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| GpuError::io(dir, e))? {
        let p = entry.map_err(|e| GpuError::io(dir, e))?.path();
        if p.extension().is_some_and(|e| e == "gguf") && p.is_file() {
            found.push(p);
            if found.len() > 1 {
                return Err(GpuError::invalid_file(
                    dir,
                    "several .gguf files: name the one to load",
                ));
            }
        }
    }
    Ok(found.pop())
}

fn file_name(path: &Path) -> String {
    path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

fn load_gguf(path: &Path) -> Result<LoadedModel, GpuError> {
    let file = GgufFile::open(path)?;
    let config = LlamaConfig::from_gguf(&file.header)?;
    let tokenizer = Tokenizer::from_gguf(&file.header)?;
    let token_text = |id: Option<u32>| -> String {
        id.and_then(|i| tokenizer.token_bytes(i))
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .unwrap_or_default()
    };
    let chat_template = match file.header.get_str("tokenizer.chat_template") {
        Some(src) => Some(ChatTemplate::new(
            src,
            &token_text(tokenizer.bos_token_id()),
            &token_text(tokenizer.eos_token_ids().first().copied()),
        )?),
        None => None,
    };
    let name = file
        .header
        .get_str("general.name")
        .map_or_else(|| file_name(path), str::to_string);
    let (header, weights) = file.into_weights()?;
    let mut config = config;
    // Phi-3's files carry LongRoPE's factors as two tensors (llama.cpp's converter).
    if weights.contains("rope_factors_long.weight") || weights.contains("rope_factors_short.weight")
    {
        config.rope_scaling = Some(gguf_long_rope(&config, &header, &weights)?);
        config.validate()?;
    }
    // Llama 3.1+ GGUF files carry the RoPE scaling as per-frequency divisors.
    if weights.contains("rope_freqs.weight") {
        if let Some(s) = &config.rope_scaling {
            return Err(GpuError::InvalidConfig(format!(
                "the file has both rope scaling keys ({s:?}) and a rope_freqs.weight tensor"
            )));
        }
        // Checked before it is converted: a quantized tensor of many blocks would be expanded
        // to f32 whole (12 bytes for every byte of Q2_K) before its length was looked at.
        let t = weights.get("rope_freqs.weight")?;
        if t.dtype.is_quantized() || t.num_elements() != config.rotary_dim / 2 {
            return Err(GpuError::BadTensor {
                tensor: "rope_freqs.weight".into(),
                reason: format!(
                    "{} {} values; the rotary dimensions need {} floats",
                    t.num_elements(),
                    t.dtype,
                    config.rotary_dim / 2
                ),
            });
        }
        let factors = t.to_f32_vec();
        let arch = header.get_str("general.architecture").unwrap_or("llama");
        let original = header
            .get_usize(&format!("{arch}.rope.scaling.original_context_length"))
            .unwrap_or(8192);
        config.rope_scaling =
            rope::from_freq_factors(&factors, config.rope_theta, config.rotary_dim, original)?;
        config.validate()?;
    }
    Ok(LoadedModel {
        config,
        weights,
        tokenizer,
        chat_template,
        name,
    })
}

/// LongRoPE from a GGUF file: the `rope_factors_short.weight` and `rope_factors_long.weight`
/// tensors, `{arch}.rope.scaling.original_context_length` and (when given)
/// `{arch}.rope.scaling.attn_factor`, as llama.cpp's converter writes Phi-3.
fn gguf_long_rope(
    config: &LlamaConfig,
    header: &super::gguf::GgufHeader,
    weights: &ModelWeights,
) -> Result<rope::RopeScaling, GpuError> {
    if let Some(s) = &config.rope_scaling {
        return Err(GpuError::InvalidConfig(format!(
            "the file has both rope scaling keys ({s:?}) and LongRoPE factor tensors"
        )));
    }
    let arch = header.get_str("general.architecture").unwrap_or("llama");
    let key = |k: &str| format!("{arch}.rope.scaling.{k}");
    let original = header
        .get_usize(&key("original_context_length"))
        .ok_or_else(|| {
            GpuError::InvalidConfig(format!(
                "LongRoPE factor tensors without {}",
                key("original_context_length")
            ))
        })?;
    let list = |name: &str| -> Result<std::sync::Arc<[f32]>, GpuError> {
        let t = weights.get(name)?;
        let n = t.num_elements();
        if n == 0 || n > rope::MAX_ROPE_PAIRS || t.dtype.is_quantized() {
            return Err(GpuError::BadTensor {
                tensor: name.into(),
                reason: format!(
                    "{n} {} values (1 to {} floats)",
                    t.dtype,
                    rope::MAX_ROPE_PAIRS
                ),
            });
        }
        Ok(t.to_f32_vec().into())
    };
    let s = rope::RopeScaling::LongRope(rope::LongRopeScaling::new(
        list("rope_factors_short.weight")?,
        list("rope_factors_long.weight")?,
        original,
        config.max_position_embeddings,
        None,
        header.get_f32(&key("attn_factor")).map(f64::from),
    )?);
    s.validate()?;
    Ok(s)
}

fn load_hf_dir(dir: &Path) -> Result<LoadedModel, GpuError> {
    let json = read_bounded(&dir.join("config.json"), MAX_CONFIG_JSON)?;
    let mut config = LlamaConfig::from_hf_json(&json)?;
    add_generation_eos(dir, &mut config)?;
    let weights = load_safetensors_dir(dir, config.tie_word_embeddings)?;
    let mut tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json"))?;
    tokenizer.set_special_ids(config.bos_token_id, config.eos_token_ids.clone());
    let tc = dir.join("tokenizer_config.json");
    let jinja = dir.join("chat_template.jinja");
    let mut chat_template = if tc.is_file() {
        ChatTemplate::from_tokenizer_config(&tc)?
    } else {
        None
    };
    if chat_template.is_none() && jinja.is_file() {
        let src = read_bounded(&jinja, super::chat_template::MAX_TEMPLATE_LEN as u64)?;
        let text = |id: Option<u32>| {
            id.and_then(|i| tokenizer.id_to_token(i))
                .unwrap_or_default()
        };
        chat_template = Some(ChatTemplate::new(
            &src,
            &text(config.bos_token_id),
            &text(config.eos_token_ids.first().copied()),
        )?);
    }
    Ok(LoadedModel {
        config,
        weights,
        tokenizer,
        chat_template,
        name: file_name(dir),
    })
}

/// Adds the end-of-sequence ids of `generation_config.json` (when there is one) to those of
/// `config.json`, as transformers' `generate` uses both: Qwen2.5-Instruct lists only
/// `<|im_end|>` in its config and `<|endoftext|>` too in its generation config.
fn add_generation_eos(dir: &Path, config: &mut LlamaConfig) -> Result<(), GpuError> {
    let path = dir.join("generation_config.json");
    if !path.is_file() {
        return Ok(());
    }
    let text = read_bounded(&path, MAX_CONFIG_JSON)?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| GpuError::invalid_file(&path, e.to_string()))?;
    let ids: Vec<&serde_json::Value> = match v.get("eos_token_id") {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(serde_json::Value::Array(list)) => list.iter().collect(),
        Some(one) => vec![one],
    };
    if ids.len() > MAX_EOS_IDS {
        return Err(GpuError::invalid_file(
            &path,
            "too many eos_token_id entries",
        ));
    }
    for id in ids {
        let id = id
            .as_u64()
            .and_then(|i| u32::try_from(i).ok())
            .ok_or_else(|| GpuError::invalid_file(&path, "eos_token_id is not a token id"))?;
        if !config.eos_token_ids.contains(&id) {
            config.eos_token_ids.push(id);
        }
    }
    config.validate()
}

/// The tensors a Llama model needs, with their expected shapes.
pub fn expected_tensors(c: &LlamaConfig) -> Vec<(String, Vec<usize>)> {
    let (h, q, kv, ff) = (
        c.hidden_size,
        c.num_heads * c.head_dim,
        c.num_kv_heads * c.head_dim,
        c.intermediate_size,
    );
    let mut v = vec![
        ("token_embd.weight".to_string(), vec![c.vocab_size, h]),
        ("output_norm.weight".to_string(), vec![h]),
    ];
    if !c.tie_word_embeddings {
        v.push(("output.weight".to_string(), vec![c.vocab_size, h]));
    }
    for i in 0..c.num_layers {
        let t = |n: &str, s: Vec<usize>| (format!("blk.{i}.{n}.weight"), s);
        v.extend([
            t("attn_norm", vec![h]),
            t("attn_q", vec![q, h]),
            t("attn_k", vec![kv, h]),
            t("attn_v", vec![kv, h]),
            t("attn_output", vec![h, q]),
            t("ffn_norm", vec![h]),
            t("ffn_gate", vec![ff, h]),
            t("ffn_up", vec![ff, h]),
            t("ffn_down", vec![h, ff]),
        ]);
        if c.qkv_bias {
            let b = |n: &str, len: usize| (format!("blk.{i}.{n}.bias"), vec![len]);
            v.extend([b("attn_q", q), b("attn_k", kv), b("attn_v", kv)]);
        }
        if c.qk_norm {
            v.extend([
                t("attn_q_norm", vec![c.head_dim]),
                t("attn_k_norm", vec![c.head_dim]),
            ]);
        }
    }
    v
}

/// Checks that every tensor the model needs is present with the right shape, and that the
/// norm weights are stored as floats, counting the tensors checked on `progress`.
pub fn validate_weights(
    config: &LlamaConfig,
    weights: &ModelWeights,
    progress: &dyn ProgressSink,
) -> Result<(), GpuError> {
    let expected = expected_tensors(config);
    // A bias or a head norm the configuration does not apply would be ignored: refused
    // instead.
    let unused = |n: &str| {
        (n.ends_with(".bias")
            || n.ends_with("attn_q_norm.weight")
            || n.ends_with("attn_k_norm.weight"))
            && !expected.iter().any(|(e, _)| e == n)
    };
    if let Some(name) = weights.names().into_iter().find(|n| unused(n)) {
        return Err(GpuError::BadTensor {
            tensor: name.to_string(),
            reason: "a bias or norm this architecture does not have".into(),
        });
    }
    // Dropped unfinished on an error: no line says the load is done.
    let step = progress.step("loading model", expected.len() as u64, "tensors");
    for (done, (name, shape)) in expected.iter().enumerate() {
        let t = weights.get(name)?;
        if &t.shape != shape {
            return Err(GpuError::BadTensor {
                tensor: name.clone(),
                reason: format!("shape {:?}, expected {shape:?}", t.shape),
            });
        }
        if (name.ends_with("norm.weight") || name.ends_with(".bias")) && t.dtype.is_quantized() {
            return Err(GpuError::BadTensor {
                tensor: name.clone(),
                reason: format!("norm weights and biases must be float, not {}", t.dtype),
            });
        }
        step.set_position(done as u64 + 1);
    }
    step.finish();
    Ok(())
}

#[cfg(test)]
#[path = "loader_tests.rs"]
mod tests;
