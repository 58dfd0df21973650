//! Configuration errors name the file, the line and the field.

use switchyard_config::{Config, ConfigError};

fn check_err(yaml: &str, expect_line: Option<usize>, expect_in_message: &str) {
    let err = Config::from_yaml_str(yaml, "test.yaml").expect_err("config should be rejected");
    let text = err.to_string();
    assert!(
        text.contains(expect_in_message),
        "message `{text}` lacks `{expect_in_message}`"
    );
    assert!(
        text.starts_with("test.yaml"),
        "message `{text}` does not name the file"
    );
    let line = match &err {
        ConfigError::Parse { line, .. } | ConfigError::Invalid { line, .. } => *line,
        other => panic!("unexpected error kind {other:?}"),
    };
    assert_eq!(line, expect_line, "wrong line in `{text}`");
}

#[test]
fn out_of_range_block_size_is_located() {
    check_err("cache:\n  block_size: 0\n", Some(2), "out of range");
    check_err("cache:\n  block_size: 0\n", Some(2), "block_size");
}

#[test]
fn unknown_field_is_named() {
    check_err("scheduler:\n  max_num_seq: 4\n", Some(2), "max_num_seq");
}

#[test]
fn wrong_type_is_located() {
    check_err(
        "server:\n  host: localhost\n  port: eighty\n",
        Some(3),
        "port",
    );
}

#[test]
fn cross_field_rule_is_located() {
    check_err(
        "tiers:\n  gold: { ttft_ms: 100 }\nserver:\n  api_keys:\n    - key: abcdefgh12\n      tenant: t\n      tier: silver\n",
        Some(7),
        "unknown tier `silver`",
    );
}

#[test]
fn a_tenant_name_longer_than_the_schedulers_label_bound_is_located() {
    let long = "t".repeat(257);
    check_err(
        &format!("server:\n  api_keys:\n    - key: abcdefgh12\n      tenant: {long}\n"),
        Some(4),
        "tenant names are 1-256 bytes",
    );
}

#[test]
fn negative_slo_is_rejected() {
    check_err("tiers:\n  gold:\n    ttft_ms: -5\n", Some(3), "positive");
}

#[test]
fn empty_file_gives_defaults() {
    let cfg = Config::from_yaml_str("", "empty.yaml").unwrap();
    assert_eq!(cfg, Config::default());
    assert_eq!(cfg.server.port, 8000);
    assert!(cfg.cache.prefix_caching);
}

#[test]
fn overrides_apply_and_are_validated() {
    let cfg = Config::from_yaml_with_overrides(
        "server: { port: 80 }",
        "o.yaml",
        &["server.port=9001".into()],
    )
    .unwrap();
    assert_eq!(cfg.server.port, 9001);
    let err =
        Config::from_yaml_with_overrides("", "o.yaml", &["cache.block_size=0".into()]).unwrap_err();
    // The error names the override and the field it set.
    let text = err.to_string();
    assert!(
        text.contains("--set cache.block_size=0") && text.contains("field `cache.block_size`"),
        "{text}"
    );
}

#[test]
fn example_configs_are_valid() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/examples");
    let mut n = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if name.ends_with(".yaml") && !name.starts_with("sim-") {
            Config::from_file(&path).unwrap_or_else(|e| panic!("{e}"));
            n += 1;
        }
    }
    assert!(n >= 1, "no example server configs found in {dir}");
}

#[test]
fn speculative_section_is_parsed_and_bounded() {
    let cfg = Config::from_yaml_str(
        "speculative:\n  num_speculative_tokens: 3\n  prompt_lookup_max: 5\n",
        "test.yaml",
    )
    .unwrap();
    let s = cfg.speculative.expect("section");
    assert_eq!(
        (
            s.num_speculative_tokens,
            s.prompt_lookup_min,
            s.prompt_lookup_max
        ),
        (3, 2, 5)
    );
    check_err(
        "speculative:\n  num_speculative_tokens: 17\n",
        Some(2),
        "num_speculative_tokens",
    );
    check_err("speculative:\n  method: eagle\n", Some(2), "method");
    check_err(
        "speculative:\n  prompt_lookup_min: 4\n  prompt_lookup_max: 3\n",
        Some(2),
        "prompt_lookup_min",
    );
}

#[test]
fn quantization_is_parsed_and_checked() {
    use switchyard_config::Quantization;
    let cfg = Config::from_yaml_str("model:\n  quantization: fp8\n", "test.yaml").unwrap();
    assert_eq!(cfg.model.quantization, Quantization::Fp8);
    let cfg = Config::from_yaml_str("model:\n  backend: cuda\n", "test.yaml").unwrap();
    assert_eq!(cfg.model.quantization, Quantization::None);
    check_err("model:\n  quantization: int4\n", Some(2), "quantization");
    assert_eq!("fp8".parse::<Quantization>(), Ok(Quantization::Fp8));
    assert_eq!("none".parse::<Quantization>(), Ok(Quantization::None));
    assert!("FP8".parse::<Quantization>().is_err());
}

#[test]
fn kv_cache_dtype_is_parsed_and_checked() {
    use switchyard_config::KvCacheDtype;
    let cfg = Config::from_yaml_str("cache:\n  kv_cache_dtype: fp8\n", "test.yaml").unwrap();
    assert_eq!(cfg.cache.kv_cache_dtype, KvCacheDtype::Fp8);
    let cfg = Config::from_yaml_str("cache:\n  block_size: 32\n", "test.yaml").unwrap();
    assert_eq!(cfg.cache.kv_cache_dtype, KvCacheDtype::Auto);
    check_err(
        "cache:\n  kv_cache_dtype: int8\n",
        Some(2),
        "kv_cache_dtype",
    );
    assert_eq!("fp8".parse::<KvCacheDtype>(), Ok(KvCacheDtype::Fp8));
    assert_eq!("auto".parse::<KvCacheDtype>(), Ok(KvCacheDtype::Auto));
    let err = "bf16".parse::<KvCacheDtype>().unwrap_err();
    assert!(err.contains("expected one of auto, fp8"), "{err}");
}

/// A `lora.adapters` name must work as a `model` value and as the one path segment of
/// `DELETE /admin/lora/{name}`: `..`, `/`, spaces and percent signs were accepted and then
/// could not be unloaded with ordinary clients.
#[test]
fn lora_adapter_names_are_url_safe() {
    let adapters = |name: &str| {
        format!("lora:\n  enabled: true\n  adapters:\n    - name: '{name}'\n      path: /srv/a\n")
    };
    for (name, says) in [
        ("..", "`..` is not an adapter name"),
        (".", "`.` is not an adapter name"),
        ("a/b", "'/' is not allowed"),
        ("a b", "' ' is not allowed"),
        ("a%2Fb", "'%' is not allowed"),
        (" lead", "' ' is not allowed"),
        ("trail ", "' ' is not allowed"),
        ("é", "'é' is not allowed"),
        ("", "1 to 128 characters"),
    ] {
        let err = Config::from_yaml_str(&adapters(name), "test.yaml")
            .expect_err(name)
            .to_string();
        assert!(err.contains("lora.adapters[0].name"), "{name:?}: {err}");
        assert!(err.contains(says), "{name:?}: {err}");
    }
    let long = "a".repeat(129);
    assert!(Config::from_yaml_str(&adapters(&long), "test.yaml").is_err());
    for good in [
        "org-model_v1.2",
        "sql-expert",
        "a:b@c+d",
        "...",
        "a..b",
        &"a".repeat(128),
    ] {
        Config::from_yaml_str(&adapters(good), "test.yaml")
            .unwrap_or_else(|e| panic!("{good}: {e}"));
        assert_eq!(switchyard_config::check_adapter_name(good), Ok(()));
    }
}

/// `lora.adapter_dirs` needs LoRA on, holds at most 16 paths of 1 to 4096 bytes.
#[test]
fn lora_adapter_dirs_are_bounded_and_need_lora() {
    let err = Config::from_yaml_str("lora:\n  adapter_dirs: [/srv/adapters]\n", "test.yaml")
        .expect_err("lora off")
        .to_string();
    assert!(
        err.contains("lora.adapter_dirs") && err.contains("lora.enabled is false"),
        "{err}"
    );
    let dirs = |list: &str| format!("lora:\n  enabled: true\n  adapter_dirs: {list}\n");
    let many = format!("[{}]", vec!["/srv/a"; 17].join(", "));
    let err = Config::from_yaml_str(&dirs(&many), "test.yaml")
        .expect_err("17 dirs")
        .to_string();
    assert!(err.contains("at most 16"), "{err}");
    let err = Config::from_yaml_str(&dirs("[/srv/a, '']"), "test.yaml")
        .expect_err("empty path")
        .to_string();
    assert!(err.contains("lora.adapter_dirs[1]"), "{err}");
    let ok = Config::from_yaml_str(&dirs("[/srv/a, ~/adapters]"), "test.yaml").expect("ok");
    assert_eq!(ok.lora.adapter_dirs, ["/srv/a", "~/adapters"]);
}
