//! SIGHUP: the configuration file is read again and its policy, `lora.adapters`, API keys,
//! tiers and `scheduler.step_timeout_s` applied.
//!
//! Reloads run one at a time, in the order of their signals (an async mutex is held for the
//! whole of one), and each is all or nothing up to the adapters: a file that does not load,
//! or whose policy the registry refuses, or whose keys would open the API ([`plan_access`]),
//! changes nothing. Tiers may be added, removed or changed (`max_kv_fraction` included: the
//! scheduler counts what each tier holds against its new bound, `Engine::set_tiers`); the
//! policy is swapped only when it differs from the one in force or the tiers changed (it is
//! built with them; a swap resets its state). Adapters are reconciled against the
//! engine's live registry, by name and directory: an adapter the file lists that is not served
//! (an admin unloaded it, or it failed before) is loaded, and one the file listed before and no
//! longer lists is unloaded if it is still served from the file's directory. The file's policy
//! wins over one set through `PUT /admin/policy` since, with a warning naming both. With
//! `server.tls`, its files (at the paths the file now names) are read again and the new
//! certificate served to new connections; a certificate or key that does not load changes
//! nothing, as a bad policy does (the policy and the certificate are both checked before
//! either is applied). Fields that take a restart (turning TLS on or off among them) are
//! compared with the configuration the server started with, and named (`server.port`,
//! `server.tls`, `cache.block_size`) in a warning while they differ.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use switchyard_api::tls::CertificateResolver;
use switchyard_api::ApiState;
use switchyard_config::{ApiKeyEntry, Config, LoraAdapterEntry, TierConfig};

use super::EngineAdapter;

/// What reloads share; one runs at a time.
pub(super) struct Reloader {
    /// The engine and the records of what is in force.
    adapter: Arc<EngineAdapter>,
    /// The configuration file.
    path: PathBuf,
    /// The `--set` overrides of the command line (environment overrides are read again).
    overrides: Vec<String>,
    /// The certificate new HTTPS connections get; `None` on plain HTTP.
    tls: Option<Arc<CertificateResolver>>,
    /// The HTTP layer, whose keys and rate limits a reload replaces.
    api: ApiState,
    /// Whether the API was started without keys (open): its keys then take a restart.
    open: bool,
    /// Held for the whole of a reload.
    state: tokio::sync::Mutex<ReloadState>,
}

/// How the server started: what a reloader compares and reloads against.
pub(super) struct Started {
    /// The configuration file.
    pub path: PathBuf,
    /// The `--set` overrides of the command line.
    pub overrides: Vec<String>,
    /// The configuration the server started with.
    pub config: Config,
    /// The adapters of `lora.adapters` served from the file, by name and directory.
    pub file_adapters: Vec<(String, PathBuf)>,
    /// The certificate resolver of an HTTPS server.
    pub tls: Option<Arc<CertificateResolver>>,
    /// The HTTP layer.
    pub api: ApiState,
    /// Whether the API was started without keys.
    pub open: bool,
}

/// What one reload leaves for the next.
struct ReloadState {
    /// The configuration the server started with (fields that take a restart are compared
    /// with it).
    started: Config,
    /// The adapters of `lora.adapters` that the last reload (or the start) served, by name and
    /// directory (`~` expanded).
    file_adapters: Vec<(String, PathBuf)>,
    /// The policy the file put in force at the last reload (or the start): one in force that
    /// differs from it was set through `PUT /admin/policy`.
    file_policy: PolicyKey,
    /// The tiers the last reload (or the start) put in force.
    tiers: BTreeMap<String, TierConfig>,
}

/// The access a reload puts in force, checked whole before anything is applied.
struct Access {
    /// The API keys; `None` on an API started open (its keys take a restart).
    keys: Option<Vec<ApiKeyEntry>>,
    /// The file's tiers.
    tiers: BTreeMap<String, TierConfig>,
    /// `server.max_pending_requests`.
    max_pending: usize,
}

/// A policy's name and its parameters as `GET /admin/policy` shows them.
#[derive(Debug, Clone, PartialEq)]
struct PolicyKey {
    /// The registered name.
    name: String,
    /// The parameters (`{}` for none).
    params: serde_json::Value,
}

impl PolicyKey {
    fn of(spec: &switchyard_config::PolicySpec) -> Self {
        Self {
            name: spec.name.clone(),
            params: super::policy_params(&spec.params),
        }
    }
}

impl std::fmt::Display for PolicyKey {
    /// `fcfs`, or `chunked-prefill {"token_budget":256}` with parameters.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.params {
            serde_json::Value::Object(m) if m.is_empty() => write!(f, "{}", self.name),
            params => write!(f, "{} {params}", self.name),
        }
    }
}

/// Whether a reload that puts `file_now` in force replaces a policy set through the admin
/// API: the policy `in_force` is neither the one the file put in force before (`file_before`)
/// nor the file's new one (which would be kept as it is).
fn replaces_admin_policy(
    file_before: &PolicyKey,
    in_force: &PolicyKey,
    file_now: &PolicyKey,
) -> bool {
    in_force != file_before && in_force != file_now
}

impl Reloader {
    /// A reloader for the server `started` describes.
    pub(super) fn new(adapter: Arc<EngineAdapter>, started: Started) -> Arc<Self> {
        Arc::new(Self {
            adapter,
            path: started.path,
            overrides: started.overrides,
            tls: started.tls,
            api: started.api,
            open: started.open,
            state: tokio::sync::Mutex::new(ReloadState {
                file_policy: PolicyKey::of(&started.config.scheduler.policy),
                tiers: started.config.tiers.clone(),
                started: started.config,
                file_adapters: started.file_adapters,
            }),
        })
    }

    /// Starts a reload in the background; it waits for the one before it to finish.
    pub(super) fn spawn(self: &Arc<Self>) {
        tracing::info!(file = %self.path.display(), "SIGHUP: reloading the configuration");
        let this = Arc::clone(self);
        actix_web::rt::spawn(async move { this.reload().await });
    }

    /// Reads the file again and applies its policy, TLS certificate and adapters.
    async fn reload(&self) {
        let mut state = self.state.lock().await;
        let cfg = match crate::commands::config::load(&self.path, &self.overrides) {
            Ok(cfg) => cfg,
            Err(e) => {
                tracing::error!(error = %format!("{e:#}"), "SIGHUP: configuration not reloaded");
                return;
            }
        };
        let restart = restart_fields(&state.started, &cfg, self.open);
        if !restart.is_empty() {
            tracing::warn!(
                "SIGHUP: changed in the file but taking a restart, so not applied: {}",
                restart.join(", ")
            );
        }
        let access = match plan_access(&cfg, self.open) {
            Ok(access) => access,
            Err(why) => {
                tracing::error!(
                    error = %why,
                    "SIGHUP: the API keys or the tiers' settings are refused; nothing was \
                     reloaded"
                );
                return;
            }
        };
        // The configuration in force after this reload, as far as it applies any: the start's,
        // with the tiers' new settings.
        let Access {
            keys,
            tiers,
            max_pending,
        } = access;
        let mut effective = state.started.clone();
        effective.tiers = tiers;
        let tiers = crate::commands::config::tier_specs(&effective);
        // Built (so checked) with the new tiers before anything is applied: a bad policy
        // leaves the adapters as they are too.
        let spec = &cfg.scheduler.policy;
        let policy = match crate::commands::config::build_policy(spec, &tiers) {
            Ok(policy) => policy,
            Err(e) => {
                tracing::error!(
                    error = %e,
                    "SIGHUP: scheduler.policy is invalid; nothing was reloaded"
                );
                return;
            }
        };
        // Read (so checked) before anything is applied too; kept while TLS is turned off in
        // the file (a restart, named above).
        let certificate = match (&self.tls, &cfg.server.tls) {
            (Some(_), Some(_)) => match crate::commands::config::tls_certificate(&cfg) {
                Ok(certificate) => certificate,
                Err((field, why)) => {
                    tracing::error!(
                        error = %format!("{field}: {why}"),
                        "SIGHUP: the TLS certificate or key does not load; the certificate in \
                         force is kept and nothing was reloaded"
                    );
                    return;
                }
            },
            _ => None,
        };
        let file_policy = PolicyKey::of(spec);
        let in_force = {
            let info = self.adapter.policy.lock();
            PolicyKey {
                name: info.name.clone(),
                params: info.params.clone(),
            }
        };
        let tiers_changed = *self.adapter.tiers.read() != tiers;
        let (info, swapped) = self.adapter.install_policy(
            file_policy.name.clone(),
            file_policy.params.clone(),
            policy,
            Some(tiers),
        );
        if tiers_changed {
            let (added, removed) = tier_set_change(&state.tiers, &effective.tiers);
            tracing::info!(
                policy = %info.name,
                added = %added.join(", "),
                removed = %removed.join(", "),
                changed = %tier_field_changes(&state.tiers, &effective.tiers).join(", "),
                "SIGHUP: the tiers changed; the policy was swapped for one built with them"
            );
        }
        if swapped && replaces_admin_policy(&state.file_policy, &in_force, &file_policy) {
            // The documented semantics (the file wins), said out loud.
            tracing::warn!(
                "SIGHUP: the policy set through PUT /admin/policy ({in_force}) is replaced by \
                 the file's ({file_policy})"
            );
        }
        state.file_policy = file_policy;
        if swapped {
            tracing::info!(policy = %info.name, "SIGHUP: policy reloaded");
        } else {
            tracing::info!(policy = %info.name, "SIGHUP: policy unchanged, left running");
        }
        if let (Some(resolver), Some(certificate)) = (&self.tls, certificate) {
            let chain = certificate.cert.len();
            switchyard_api::tls::report_expiry(&certificate);
            if resolver.replace(certificate) {
                tracing::info!(
                    chain,
                    "SIGHUP: TLS certificate reloaded; new connections get the new one"
                );
            } else {
                tracing::info!(chain, "SIGHUP: TLS certificate unchanged");
            }
        }
        self.apply_access(&mut state, keys, effective, max_pending);
        let limit = cfg.scheduler.step_timeout(self.adapter.device_backend);
        let before = self.adapter.engine.step_timeout();
        if limit != before {
            self.adapter.engine.set_step_timeout(limit);
            let secs = |l: Option<std::time::Duration>| l.map_or(0, |l| l.as_secs());
            tracing::info!(
                "SIGHUP: scheduler.step_timeout_s: {} -> {}",
                secs(before),
                secs(limit)
            );
        }
        // A change of lora.enabled is among the fields that take a restart.
        if self.adapter.lora_enabled && cfg.lora.enabled {
            self.reconcile_adapters(&mut state, &cfg.lora.adapters)
                .await;
        }
        tracing::info!("SIGHUP: reload finished");
    }

    /// Puts `keys` (none on an API started open), `effective`'s tiers and `max_pending` in
    /// force: the keys and rate limits in the HTTP layer, the tiers' priorities, the bounds on
    /// requests in flight, the tenants' shares of LoRA adapter memory and the tenants that
    /// label metrics in the engine; the series of a tenant or tier removed leave `/metrics`
    /// (hidden there by the HTTP layer, which `reload_access` hands the new keys and tiers).
    fn apply_access(
        &self,
        state: &mut ReloadState,
        keys: Option<Vec<ApiKeyEntry>>,
        effective: Config,
        max_pending: usize,
    ) {
        *self.adapter.tier_priorities.write() = super::tier_priorities(&effective);
        super::register_tier_series(&effective);
        let tenants = keys.as_ref().map(|k| super::key_tenants(&effective, k));
        let api_keys = keys.map_or_else(Vec::new, super::api_keys);
        match self.api.reload_access(
            api_keys,
            super::rate_limits(&effective),
            effective.tiers.keys().cloned().collect(),
        ) {
            Ok(change) => {
                if !self.open {
                    tracing::info!(
                        added = change.keys_added,
                        removed = change.keys_removed,
                        changed = change.keys_changed,
                        "SIGHUP: API keys reloaded"
                    );
                }
                for tier in change.limits_changed {
                    tracing::info!(%tier, "SIGHUP: the tier's rate limits changed");
                }
            }
            // Checked before (`plan_access`); said if it ever happens.
            Err(e) => tracing::error!(error = %e, "SIGHUP: API keys and rate limits not reloaded"),
        }
        if let Some(tenants) = tenants {
            switchyard_actors::metric_names::register_tenants(&tenants);
            self.adapter
                .engine
                .set_metrics_tenants(tenants.into_iter().map(|(t, _)| t).collect());
        }
        let shares = crate::commands::config::tier_lora_share_limits(&effective);
        let before: Vec<(String, usize)> = (state.tiers.iter())
            .filter_map(|(name, t)| Some((name.clone(), t.max_cpu_loras_per_tenant?)))
            .collect();
        if shares != before {
            tracing::info!(
                ?shares,
                "SIGHUP: tenants' shares of LoRA adapter memory changed"
            );
        }
        self.adapter.engine.set_lora_tenant_shares(&shares);
        let bounds = self.adapter.engine.set_admission_limits(
            max_pending,
            &crate::commands::config::tier_pending_limits(&effective),
            &crate::commands::config::tier_pending_per_tenant_limits(&effective),
        );
        match bounds {
            Ok(changed) => {
                for bound in changed {
                    tracing::info!(%bound, "SIGHUP: bound on requests in flight changed");
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "SIGHUP: bounds on requests in flight not reloaded")
            }
        }
        state.tiers = effective.tiers;
    }

    /// Brings the served adapters in line with `wanted`, the file's list, against the engine's
    /// live registry; failures are logged and leave the rest going.
    async fn reconcile_adapters(&self, state: &mut ReloadState, wanted: &[LoraAdapterEntry]) {
        let engine = &self.adapter.engine;
        let served = |name: &str| {
            engine
                .adapters()
                .into_iter()
                .find(|a| a.name == name)
                .map(|a| (a.path, a.pinned, a.discovered))
        };
        let wanted: Vec<(String, PathBuf, bool)> = wanted
            .iter()
            .map(|a| {
                (
                    a.name.clone(),
                    switchyard_config::expand_home(&a.path),
                    a.pinned,
                )
            })
            .collect();
        // The file's adapters it no longer lists, when still served from the file's directory
        // (one replaced through the admin API since is the admin's). One it lists in another
        // directory is replaced in place below, never unloaded first: its name is never
        // missing, and new files that do not load leave it served.
        for (name, path) in &state.file_adapters {
            let listed = wanted.iter().any(|(n, _, _)| n == name);
            if listed || served(name).map(|s| s.0).as_ref() != Some(path) {
                continue;
            }
            match engine.unregister_adapter(name.clone()).await {
                Ok(()) => tracing::info!(%name, "SIGHUP: LoRA adapter unloaded"),
                Err(e) => {
                    tracing::warn!(%name, error = %e, "SIGHUP: LoRA adapter not unloaded")
                }
            }
        }
        let mut applied = Vec::new();
        for (name, path, pinned) in wanted {
            match served(&name) {
                // Found by a request in lora.adapter_dirs at the file's path: still taken
                // as the file's below (replaced in place, the same weights keeping their id),
                // or it would stay a found adapter, unregistered to make room for others.
                Some((p, was_pinned, false)) if p == path => {
                    if was_pinned != pinned {
                        match engine.pin_adapter(name.clone(), pinned).await {
                            Ok(_) => {
                                tracing::info!(%name, pinned, "SIGHUP: LoRA adapter pinning changed")
                            }
                            Err(e) => {
                                tracing::error!(%name, pinned, error = %e, "SIGHUP: LoRA adapter pinning not changed")
                            }
                        }
                    }
                    applied.push((name, path));
                    continue;
                }
                Some((p, _, discovered)) => {
                    // Moved in the file, or loaded through the admin API (or found in
                    // lora.adapter_dirs) from another directory: the file's entry is what the
                    // operator asks SIGHUP to serve. Replaced in place: the name is never
                    // missing, and a file that does not load leaves the adapter served as it
                    // was.
                    let the_files = state
                        .file_adapters
                        .iter()
                        .any(|(n, fp)| *n == name && *fp == p);
                    if discovered && p == path {
                        tracing::info!(
                            %name,
                            path = %path.display(),
                            "SIGHUP: LoRA adapter found in lora.adapter_dirs is now the file's"
                        );
                    } else if the_files {
                        tracing::info!(
                            %name,
                            from = %p.display(),
                            to = %path.display(),
                            "SIGHUP: LoRA adapter moved in the file; replacing it in place"
                        );
                    } else {
                        tracing::warn!(
                            %name,
                            from = %p.display(),
                            to = %path.display(),
                            "SIGHUP: LoRA adapter served from another directory; replacing it \
                             with the file's"
                        );
                    }
                    match engine
                        .replace_adapter(name.clone(), path.clone(), pinned)
                        .await
                    {
                        Ok(info) => {
                            tracing::info!(name = %info.name, rank = info.rank, "SIGHUP: LoRA adapter replaced");
                            applied.push((name, path));
                        }
                        Err(e) => {
                            tracing::error!(%name, error = %e, "SIGHUP: LoRA adapter not replaced; the one served stays");
                            // Still the file's adapter, from its former directory: a later
                            // SIGHUP that no longer lists it unloads it.
                            if the_files {
                                applied.push((name, p));
                            }
                        }
                    }
                    continue;
                }
                None => {}
            }
            match engine
                .register_adapter(name.clone(), path.clone(), pinned)
                .await
            {
                Ok(info) => {
                    tracing::info!(name = %info.name, rank = info.rank, "SIGHUP: LoRA adapter loaded");
                    applied.push((name, path));
                }
                Err(e) => {
                    tracing::error!(%name, error = %e, "SIGHUP: LoRA adapter not loaded")
                }
            }
        }
        state.file_adapters = applied;
    }
}

/// The tiers `after` has that `before` has not, and those it no longer has, by name.
fn tier_set_change(
    before: &BTreeMap<String, TierConfig>,
    after: &BTreeMap<String, TierConfig>,
) -> (Vec<String>, Vec<String>) {
    let only = |a: &BTreeMap<String, TierConfig>, b: &BTreeMap<String, TierConfig>| {
        a.keys().filter(|k| !b.contains_key(*k)).cloned().collect()
    };
    (only(after, before), only(before, after))
}

/// The settings of the tiers kept whose value changed, as `tiers.gold.ttft_ms: 200 -> 300`
/// (`none` for a setting left out), so that a changed SLO target or weight is named in the
/// log as a changed bound is.
fn tier_field_changes(
    before: &BTreeMap<String, TierConfig>,
    after: &BTreeMap<String, TierConfig>,
) -> Vec<String> {
    switchyard_config::tier_field_changes(before, after)
        .into_iter()
        .map(|c| format!("tiers.{}.{}: {} -> {}", c.tier, c.field, c.from, c.to))
        .collect()
}

/// Checks what `cfg` asks of the API's access: its keys (unless the API was started `open`),
/// which must leave at least one key (the file's keys and tiers were checked together when it
/// loaded: a key names a tier the file configures, a tier's bounds are within the server's).
fn plan_access(cfg: &Config, open: bool) -> Result<Access, String> {
    let keys = if open {
        None
    } else {
        let keys = cfg.load_api_keys().map_err(|e| e.to_string())?;
        if keys.is_empty() {
            return Err(switchyard_api::AccessRefusal::WouldOpenApi.to_string());
        }
        Some(keys)
    };
    Ok(Access {
        keys,
        tiers: cfg.tiers.clone(),
        max_pending: cfg.server.max_pending_requests,
    })
}

/// The fields of `new` that differ from `old` and that a reload does not apply, dotted
/// (`server.port`, `server.tls`, `cache.block_size`), in the order of the schema's sections
/// and fields. A reload applies `scheduler.policy`, `lora.adapters`, the files of
/// `server.tls` (turned on or off only by a restart), the API keys (`server.api_keys`,
/// `server.api_keys_file`) unless the API was started `open`, `server.max_pending_requests`,
/// and `tiers` (added, removed, or with new settings).
fn restart_fields(old: &Config, new: &Config, open: bool) -> Vec<String> {
    let mut new = new.clone();
    new.scheduler.policy = old.scheduler.policy.clone();
    new.lora.adapters = old.lora.adapters.clone();
    if old.server.tls.is_some() && new.server.tls.is_some() {
        new.server.tls = old.server.tls.clone();
    }
    if !open {
        new.server.api_keys = old.server.api_keys.clone();
        new.server.api_keys_file = old.server.api_keys_file.clone();
    }
    new.server.max_pending_requests = old.server.max_pending_requests;
    new.scheduler.step_timeout_s = old.scheduler.step_timeout_s;
    new.tiers = old.tiers.clone();
    let value = |c: &Config| serde_yaml::to_value(c).unwrap_or(serde_yaml::Value::Null);
    let mut out = Vec::new();
    differing_fields("", &value(old), &value(&new), &mut out);
    out
}

/// Appends to `out` the paths under `path` where `a` and `b` differ: mappings are compared
/// key by key, anything else (a list, a value) as a whole.
fn differing_fields(
    path: &str,
    a: &serde_yaml::Value,
    b: &serde_yaml::Value,
    out: &mut Vec<String>,
) {
    use serde_yaml::Value;
    if a == b {
        return;
    }
    let (Value::Mapping(a), Value::Mapping(b)) = (a, b) else {
        out.push(path.to_string());
        return;
    };
    let field = |key: &Value| {
        let key = match key {
            Value::String(k) => k.clone(),
            other => serde_yaml::to_string(other)
                .unwrap_or_default()
                .trim()
                .to_string(),
        };
        if path.is_empty() {
            key
        } else {
            format!("{path}.{key}")
        }
    };
    for (key, va) in a {
        differing_fields(&field(key), va, b.get(key).unwrap_or(&Value::Null), out);
    }
    for (key, vb) in b {
        if !a.contains_key(key) {
            differing_fields(&field(key), &Value::Null, vb, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(yaml: &str) -> Config {
        Config::from_yaml_str(yaml, "t.yaml").expect("valid")
    }

    #[test]
    fn only_fields_a_reload_does_not_apply_take_a_restart_and_are_named() {
        let old = config("lora: { enabled: true }\nscheduler: { policy: { name: fcfs } }\n");
        let same = config(
            "lora: { enabled: true, adapters: [{ name: a, path: /a }] }\n\
             scheduler: { policy: { name: priority }, step_timeout_s: 60 }\n",
        );
        assert!(restart_fields(&old, &same, true).is_empty());
        let changed = config(
            "lora: { enabled: true, max_loras: 2 }\ncache: { block_size: 32 }\n\
             tiers: { gold: { ttft_ms: 100 } }\nscheduler: { max_num_seqs: 8 }\n",
        );
        assert_eq!(
            restart_fields(&old, &changed, true),
            [
                "cache.block_size",
                "scheduler.max_num_seqs",
                "lora.max_loras"
            ]
        );
        let moved = config(
            "lora: { enabled: true }\nscheduler: { policy: { name: fcfs } }\n\
             server: { port: 9001, api_keys: [{ key: abcdefghijklmnop, tenant: t }] }\n",
        );
        assert_eq!(
            restart_fields(&old, &moved, true),
            ["server.port", "server.api_keys"]
        );
        // TLS: other files are reloaded; turning it on or off takes a restart.
        let tls = |files: &str| {
            config(&format!(
                "server: {{ tls: {{ cert_file: {files}.pem, key_file: {files}.key }} }}\n"
            ))
        };
        let plain = config("");
        assert!(restart_fields(&tls("/a"), &tls("/b"), true).is_empty());
        assert_eq!(restart_fields(&plain, &tls("/a"), true), ["server.tls"]);
        assert_eq!(restart_fields(&tls("/a"), &plain, true), ["server.tls"]);
        let cors = config("server: { cors: { allowed_origins: ['*'] } }\n");
        assert_eq!(restart_fields(&plain, &cors, true), ["server.cors"]);
    }

    #[test]
    fn keys_and_tiers_reload_tiers_added_removed_and_their_kv_bounds_included() {
        let old = config(
            "tiers: { gold: { requests_per_minute: 10 }, free: { max_pending_requests: 4 } }\n\
             server: { api_keys: [{ key: abcdefghijklmnop, tenant: t, tier: gold }] }\n",
        );
        let new = config(
            "tiers: { gold: { requests_per_minute: 20, tokens_per_minute: 1000, \
             max_pending_per_tenant: 2, max_kv_fraction: 0.5 }, silver: {} }\n\
             server: { max_pending_requests: 64, api_keys: [\
             { key: abcdefghijklmnop, tenant: t, tier: gold }, \
             { key: qrstuvwxyz012345, tenant: u, tier: silver }] }\n",
        );
        assert!(restart_fields(&old, &new, false).is_empty());
        // On an API started open, keys take a restart.
        assert_eq!(restart_fields(&old, &new, true), ["server.api_keys"]);
        let access = plan_access(&new, false).unwrap();
        assert_eq!(access.max_pending, 64);
        assert_eq!(access.keys.as_ref().map(Vec::len), Some(2));
        assert_eq!(access.tiers.keys().collect::<Vec<_>>(), ["gold", "silver"]);
        let gold = &access.tiers["gold"];
        assert_eq!(
            (
                gold.requests_per_minute,
                gold.tokens_per_minute,
                gold.max_pending_per_tenant,
                gold.max_kv_fraction
            ),
            (Some(20), Some(1000), Some(2), Some(0.5))
        );
        assert_eq!(
            tier_set_change(&old.tiers, &new.tiers),
            (vec!["silver".to_owned()], vec!["free".to_owned()])
        );
        assert!(plan_access(&new, true).unwrap().keys.is_none());
    }

    #[test]
    fn a_reload_that_would_leave_no_key_is_refused() {
        let keyless = config("tiers: { gold: {} }\n");
        let e = plan_access(&keyless, false).err().unwrap();
        assert_eq!(e, switchyard_api::AccessRefusal::WouldOpenApi.to_string());
        // A key naming a tier the file does not configure never gets this far: the file is
        // refused when it loads.
        let unknown = Config::from_yaml_str(
            "tiers: { gold: {} }\n\
             server: { api_keys: [{ key: abcdefghijklmnop, tenant: t, tier: silver }] }\n",
            "t.yaml",
        );
        assert!(unknown.is_err());
    }

    fn key(name: &str, params: serde_json::Value) -> PolicyKey {
        PolicyKey {
            name: name.into(),
            params,
        }
    }

    #[test]
    fn a_reload_replaces_an_admin_set_policy_only_when_it_swaps_one_the_file_did_not_set() {
        let none = || serde_json::json!({});
        let fcfs = key("fcfs", none());
        let priority = key("priority", none());
        let budget = |n: u64| key("chunked-prefill", serde_json::json!({ "token_budget": n }));
        // The file's policy still in force: nothing an admin set.
        assert!(!replaces_admin_policy(&fcfs, &fcfs, &priority));
        // An admin swapped to priority: the file's fcfs (unchanged or not) replaces it.
        assert!(replaces_admin_policy(&fcfs, &priority, &fcfs));
        assert!(replaces_admin_policy(&fcfs, &priority, &budget(256)));
        // Parameters count: an admin's other budget is replaced too.
        assert!(replaces_admin_policy(
            &budget(256),
            &budget(512),
            &budget(256)
        ));
        // The file now names what the admin set: kept, nothing replaced.
        assert!(!replaces_admin_policy(&fcfs, &priority, &priority));
        assert_eq!(
            budget(256).to_string(),
            r#"chunked-prefill {"token_budget":256}"#
        );
        assert_eq!(fcfs.to_string(), "fcfs");
    }
}
