//! The LoRA manager: the adapters the server knows by name, loaded from disk on the manager's
//! own thread (a one-thread `SyncArbiter`), so neither HTTP workers nor the scheduler ever wait
//! on a file.
//!
//! Lifecycle. An adapter is *registered* under a name (from the configuration at start, or at
//! run time through the admin API); registering loads it once, so a bad file is refused at
//! once with its reason. Each registration gets a fresh id, never reused in the process: the id
//! is part of the prefix-cache key, so a name registered again with other weights never shares
//! cached blocks with its previous version. A request naming an adapter *resolves* it to its
//! id and weights (`Arc<LoraAdapter>`) before it is queued; the request holds the weights until
//! it ends, so unregistering or evicting an adapter never pulls weights from under a running
//! request.
//!
//! Resolution. The registered names and the adapters in memory are published in a
//! [`LoraRegistry`] (behind a read-write lock) that the submit path reads directly: a request
//! for an adapter in memory never goes through the manager's thread, so an admin load or the
//! reload of another adapter (seconds for a large one) does not hold it up. Only an adapter
//! that was evicted is resolved by the manager, which loads it again. The manager is the only
//! writer of the registry: only it loads, registers, evicts and unregisters.
//!
//! Directories. With `adapter_dirs` (vLLM's filesystem resolver), a request naming an adapter
//! that is not registered is served the adapter in `<dir>/<name>/` of the first directory that
//! holds an `adapter_config.json` there: the manager registers it (*discovered*) on that first
//! request, and it is then served as any other. The name passed the same check as every
//! registration (one path segment, never `.` or `..`), so the path stays inside the directory.
//! Discovered adapters make room for one another and for an operator's registrations: when
//! the registry is full, the least recently used discovered adapter that no request holds
//! and that is not pinned is unregistered (it is found again on its next request), once the
//! new adapter has loaded; the request that registers one gets its weights even when the
//! eviction that follows would drop them from memory at once, so its files are read once. A
//! request's name check ([`LoraHandle::find`]) only looks in the directories (on the
//! directory scanner's thread): it reads, registers and keeps nothing, so any number of
//! checks of new adapters in flight at once never read an adapter twice nor hold memory; the
//! request that follows reads the adapter (once) when it resolves the name. A discovered
//! adapter whose files are gone or broken when it is loaded again is unregistered, so it is
//! found again, or not, as its directory then says.
//!
//! Memory. At most `max_adapters` names are registered and at most `max_loaded` adapters are
//! kept in memory, those in use included; beyond that, the least recently used adapter that no
//! request holds is dropped and loaded again on its next request. Adapters in use are never
//! dropped, nor are pinned ones (at most `max_loaded` are pinned), so while more than
//! `max_loaded` are in use all of them stay (memory is then bounded
//! by `max_adapters` adapters of at most `max_lora_rank`), and the excess is dropped once they
//! are released: by the manager's next load, or on the next request for an adapter in memory,
//! which asks the manager to evict again. How many different adapters run in one step is the
//! scheduler's limit (`max_loras`).
//!
//! Tenants' shares. An adapter read into memory for a request is charged to the request's
//! tenant ([`Charge`]); an operator's registrations and pinned adapters to no one. A tier may
//! bound what each of its tenants is charged (`tiers.<name>.max_cpu_loras_per_tenant`,
//! [`LoraHandle::set_tenant_shares`]): a load for a tenant whose charged adapters fill its
//! share first drops the tenant's own least recently used one that no request holds (chosen
//! and dropped under one write lock, as every eviction), and is refused
//! ([`LoraError::TenantShare`], a 429) when every one is in use. So a tenant naming many
//! adapters recycles its own slots once its share is full and displaces at most its share of
//! the other tenants' adapters; an adapter in memory still serves every tenant, whoever it is
//! charged to.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use actix::{Actor, Addr, Handler, Message, SyncArbiter, SyncContext};
use parking_lot::RwLock;
use switchyard_gpu::model::LlamaConfig;
use switchyard_gpu::{GpuError, LoraAdapter, LoraLimits};

use super::lora_dirs::{check_name, holds_adapter, locate, DirectoryScanner, Holds, ListFound};

/// Settings of the LoRA manager.
#[derive(Clone, Debug)]
pub struct LoraManagerConfig {
    /// The base model adapters must fit.
    pub model: LlamaConfig,
    /// The base model's served name (no adapter may take it).
    pub base_name: String,
    /// Bounds on adapter files.
    pub limits: LoraLimits,
    /// Most adapters registered at once.
    pub max_adapters: usize,
    /// Most adapters kept in memory, those in use included (adapters in use are never dropped,
    /// so more stay while more are in use).
    pub max_loaded: usize,
    /// Directories searched, in order, for an adapter a request names that is not registered
    /// (`<dir>/<name>/`); empty: none is.
    pub adapter_dirs: Vec<PathBuf>,
    /// The names the served model goes by (its served name first, then its own and its
    /// file's or directory's), which an adapter's `base_model_name_or_path` is compared with
    /// ([`names_served_model`]); empty: none is.
    pub model_names: Vec<String>,
    /// Per tier, most adapters each of its tenants may be charged for in memory
    /// (`tiers.<name>.max_cpu_loras_per_tenant`); tiers not listed bound none.
    pub tenant_shares: Vec<(String, usize)>,
}

/// Who a request's adapter load is charged to: its tenant, within its tier's share of memory
/// (`tiers.<name>.max_cpu_loras_per_tenant`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Charge {
    /// The request's tenant.
    pub tenant: Arc<str>,
    /// The request's tier.
    pub tier: Arc<str>,
}

/// A registered adapter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdapterInfo {
    /// The name requests use (`model` in the OpenAI API).
    pub name: String,
    /// The id of this registration (prefix-cache key; never reused).
    pub id: u32,
    /// The adapter's directory.
    pub path: PathBuf,
    /// Its rank.
    pub rank: usize,
    /// Found in one of the `adapter_dirs` on a request, rather than registered by the
    /// configuration or an admin: unregistered to make room for another registration
    /// (unless pinned).
    pub discovered: bool,
    /// Kept in memory while registered, never evicted (at most `max_loaded` adapters are):
    /// its requests never wait for its files to load again.
    pub pinned: bool,
    /// The model it was trained on, as its `adapter_config.json` names it
    /// (`base_model_name_or_path`), if it does.
    pub base_model: Option<String>,
    /// `base_model` names none of the served model's names ([`names_served_model`]): served
    /// all the same (its shapes fit, and names differ across mirrors and local paths), with a
    /// warning logged when it was loaded.
    pub base_model_differs: bool,
}

/// Whether `base`, an adapter's `base_model_name_or_path` (a hub id such as
/// `HuggingFaceTB/SmolLM2-135M-Instruct`, or a local path), names the model known by `names`:
/// its last path segment is one of them (or one's part before its first `.`, as a file name's
/// quantization suffix, `SmolLM2-135M-Instruct.Q4_1`), compared by letters and digits alone,
/// without case. Without names, or without letters or digits in `base`, nothing is compared
/// (true).
pub fn names_served_model(base: &str, names: &[String]) -> bool {
    fn key(s: &str) -> String {
        s.chars()
            .filter(|c| c.is_alphanumeric())
            .flat_map(char::to_lowercase)
            .collect()
    }
    fn last_segment(s: &str) -> &str {
        let s = s.trim_end_matches(['/', '\\']);
        s.rsplit(['/', '\\']).next().unwrap_or(s)
    }
    let want = key(last_segment(base));
    if want.is_empty() || names.is_empty() {
        return true;
    }
    names
        .iter()
        .map(|n| last_segment(n))
        .any(|n| key(n) == want || n.split_once('.').is_some_and(|(stem, _)| key(stem) == want))
}

/// What can go wrong with adapters.
#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    /// No adapter is registered under the name.
    #[error("no LoRA adapter named '{0}'")]
    Unknown(String),
    /// The name is taken.
    #[error(
        "a LoRA adapter named '{0}' is already loaded; unload it first, or send \"load_inplace\": true to replace it"
    )]
    Exists(String),
    /// The name is not one [`switchyard_config::check_adapter_name`] accepts (1 to 128 ASCII
    /// letters, digits and `.` `_` `-` `:` `@` `+`, not `.` or `..`), or is the base model's.
    #[error("bad LoRA adapter name: {0}")]
    BadName(String),
    /// The registry is full.
    #[error("{0} LoRA adapters are loaded, the configured maximum (lora.max_adapters); unload one first")]
    Full(usize),
    /// The adapter's files are missing, malformed or do not fit the model (registering: the
    /// caller named the path, so the reason is theirs to read).
    #[error(transparent)]
    Load(#[from] GpuError),
    /// A registered adapter that was evicted could not be loaded again: the server's files
    /// broke since it was registered. The detail (path and reason) is logged, not returned.
    #[error("LoRA adapter '{0}' could not be loaded")]
    Reload(String),
    /// An adapter found in a directory cannot be registered: the registry is full and every
    /// other adapter found so is in use (or there are none).
    #[error(
        "LoRA adapter '{0}' cannot be loaded now: all {1} adapters registered \
         (lora.max_adapters) are in use or were not found in lora.adapter_dirs"
    )]
    Busy(String, usize),
    /// LoRA is not enabled in this server.
    #[error("LoRA adapters are not enabled on this server (lora.enabled)")]
    Disabled,
    /// The request's tenant is charged for as many adapters in memory as its tier's share
    /// allows, all in use, and its adapter is not in memory.
    #[error(
        "your LoRA adapters fill your share of adapter memory (tiers.{tier}.max_cpu_loras_per_tenant: \
         {limit}) and all are in use; retry when a request using one of them ends"
    )]
    TenantShare {
        /// The request's tier.
        tier: String,
        /// Its share.
        limit: usize,
    },
    /// Pinning the adapter would pin more adapters than may be kept in memory.
    #[error(
        "{0} LoRA adapters are pinned, as many as are kept in memory (lora.max_cpu_loras); \
         unpin one first"
    )]
    PinLimit(usize),
    /// The manager is gone (the engine is shutting down).
    #[error("the engine is shutting down")]
    Stopped,
}

/// An adapter held in memory.
struct Resident {
    /// The id its weights are cached under.
    id: u32,
    /// The weights; each request using them holds a clone until it ends.
    adapter: Arc<LoraAdapter>,
    /// When a request last resolved it (the registry's clock), for least-recently-used
    /// eviction; readers update it under the read lock.
    last_used: AtomicU64,
    /// The tenant whose request read it into memory (its share, `Charge`); `None`: an
    /// operator's registration or replacement.
    owner: Option<Arc<str>>,
}

/// The contents of a [`LoraRegistry`].
#[derive(Default)]
struct RegistryState {
    /// Every registered adapter, in registration order.
    adapters: Vec<AdapterInfo>,
    /// The adapters in memory, by name.
    resident: HashMap<String, Resident>,
}

impl RegistryState {
    /// Removes `name`'s registration: `None` when it has none, else its weights in memory if
    /// they were (for the caller to drop once the lock is released).
    fn remove(&mut self, name: &str) -> Option<Option<Resident>> {
        let i = self.adapters.iter().position(|a| a.name == name)?;
        self.adapters.remove(i);
        Some(self.resident.remove(name))
    }
}

/// What a [`LoraRegistry`] shares between its clones.
#[derive(Default)]
struct SharedRegistry {
    /// Registered and resident adapters; written only by the manager.
    state: RwLock<RegistryState>,
    /// Ticks at every resolution (the `last_used` of [`Resident`]).
    clock: AtomicU64,
    /// Set when the manager left more than `max_loaded` adapters in memory because they were
    /// in use; the next request served from memory takes it and asks the manager to evict.
    over_limit: AtomicBool,
    /// Per tier, the most adapters each of its tenants may be charged for in memory.
    shares: RwLock<HashMap<String, usize>>,
}

/// The registered adapters and the weights of those in memory, as other threads see them:
/// model lists, name checks and, for adapters in memory, request resolution, all without a
/// trip through the manager's thread.
#[derive(Clone, Default)]
pub struct LoraRegistry(Arc<SharedRegistry>);

/// What the registry knows of a name.
enum Lookup {
    /// In memory: the id and the weights.
    Resident(u32, Arc<LoraAdapter>),
    /// Registered, but evicted from memory: the manager must load it again.
    Evicted,
    /// Not registered.
    Unknown,
}

impl LoraRegistry {
    /// Every registered adapter, in registration order.
    pub fn list(&self) -> Vec<AdapterInfo> {
        self.0.state.read().adapters.clone()
    }

    /// Whether an adapter is registered under `name` (without copying the registry).
    pub fn contains(&self, name: &str) -> bool {
        self.0.state.read().adapters.iter().any(|a| a.name == name)
    }

    /// The id and weights of `name` if they are in memory, marking it used.
    fn lookup(&self, name: &str) -> Lookup {
        let state = self.0.state.read();
        if let Some(r) = state.resident.get(name) {
            r.last_used.store(self.tick(), Ordering::Relaxed);
            Lookup::Resident(r.id, r.adapter.clone())
        } else if state.adapters.iter().any(|a| a.name == name) {
            Lookup::Evicted
        } else {
            Lookup::Unknown
        }
    }

    /// The registration of `name`.
    fn info(&self, name: &str) -> Option<AdapterInfo> {
        let state = self.0.state.read();
        state.adapters.iter().find(|a| a.name == name).cloned()
    }

    /// The next value of the registry's clock.
    fn tick(&self) -> u64 {
        self.0.clock.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Whether the manager should evict again (true once per time it was left over the limit).
    fn take_over_limit(&self) -> bool {
        self.0.over_limit.load(Ordering::Relaxed) && self.0.over_limit.swap(false, Ordering::AcqRel)
    }
}

/// What the engine holds of the LoRA manager: its address, for registrations and reloads, and
/// the registry it publishes, read directly for adapters in memory.
#[derive(Clone)]
pub struct LoraHandle {
    /// The manager's thread.
    addr: Addr<LoraManager>,
    /// The manager's registry.
    registry: LoraRegistry,
    /// Names not registered are looked for in directories (`adapter_dirs`).
    discovers: bool,
    /// The thread that lists what the directories hold (with `adapter_dirs` only).
    scanner: Option<Addr<DirectoryScanner>>,
}

impl LoraHandle {
    /// Starts the manager on a thread of its own; must run inside an actix `System`.
    pub fn start(config: LoraManagerConfig) -> Self {
        let registry = LoraRegistry::default();
        let view = registry.clone();
        let discovers = !config.adapter_dirs.is_empty();
        let scanner = discovers.then(|| {
            let (dirs, base) = (config.adapter_dirs.clone(), config.base_name.clone());
            SyncArbiter::start(1, move || DirectoryScanner::new(dirs.clone(), base.clone()))
        });
        let addr = SyncArbiter::start(1, move || LoraManager::new(config.clone(), view.clone()));
        LoraHandle {
            addr,
            registry,
            discovers,
            scanner,
        }
    }

    /// The names of the adapters `adapter_dirs` hold now (sorted; registered or not, nothing
    /// loaded), as a request would find them; see [`super::lora_dirs`]. Empty without
    /// directories, or once the engine is stopping.
    pub async fn in_directories(&self) -> Arc<Vec<String>> {
        match &self.scanner {
            Some(scanner) => scanner
                .send(ListFound)
                .await
                .unwrap_or_else(|_| Arc::default()),
            None => Arc::default(),
        }
    }

    /// Whether requests may name `name`: registered, or held now by one of `adapter_dirs`
    /// (looked for on the directory scanner's thread, never behind the manager's loads).
    /// Nothing is read, registered or kept: the request that follows reads the adapter once,
    /// when it resolves the name, and holds it.
    pub async fn find(&self, name: &str) -> Result<bool, LoraError> {
        if self.registry.contains(name) {
            return Ok(true);
        }
        match &self.scanner {
            Some(scanner) => scanner
                .send(Holds(name.to_owned()))
                .await
                .map_err(|_| LoraError::Stopped),
            None => Ok(false),
        }
    }

    /// The registered adapters.
    pub fn registry(&self) -> &LoraRegistry {
        &self.registry
    }

    /// Puts the tiers' shares of adapter memory per tenant in force (a reload): loads from
    /// now on are bounded by them; adapters already charged stay until their tenant's next
    /// load makes room (a tenant over a lowered share drops its unused ones then).
    pub fn set_tenant_shares(&self, shares: &[(String, usize)]) {
        *self.registry.0.shares.write() = shares.iter().cloned().collect();
    }

    /// The id and weights of `name`: from the registry when they are in memory (without
    /// waiting for the manager, whatever it is doing), else loaded by the manager, charged
    /// to `charge`'s tenant (none: an uncharged load).
    pub async fn resolve(
        &self,
        name: &str,
        charge: Option<&Charge>,
    ) -> Result<(u32, Arc<LoraAdapter>), LoraError> {
        match self.registry.lookup(name) {
            Lookup::Resident(id, adapter) => {
                if self.registry.take_over_limit() {
                    self.addr.do_send(Evict);
                }
                Ok((id, adapter))
            }
            Lookup::Evicted => self.ask(Resolve(name.to_owned(), charge.cloned())).await,
            Lookup::Unknown if self.discovers => {
                self.ask(Resolve(name.to_owned(), charge.cloned())).await
            }
            Lookup::Unknown => Err(LoraError::Unknown(name.to_owned())),
        }
    }

    /// Sends `msg` to the manager and waits for its answer.
    pub async fn ask<M, T>(&self, msg: M) -> Result<T, LoraError>
    where
        M: Message<Result = Result<T, LoraError>> + Send + 'static,
        T: Send + 'static,
        LoraManager: Handler<M>,
    {
        self.addr.send(msg).await.unwrap_or(Err(LoraError::Stopped))
    }
}

/// A registration, with the adapter's weights when the registering caller holds them.
type Registered = (AdapterInfo, Option<Arc<LoraAdapter>>);

/// Who keeps a new registration's weights from the eviction that follows it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Keep {
    /// No one (the configuration's and an admin's registrations).
    Nobody,
    /// The caller, which gets them (a request resolving a name it found).
    Caller,
}

/// The LoRA manager actor.
pub struct LoraManager {
    config: LoraManagerConfig,
    /// What the weights under each registered name's id are ([`LoraAdapter::fingerprint`]).
    fingerprints: HashMap<String, [u8; 32]>,
    next_id: u32,
    /// What the manager publishes; it is the only writer.
    registry: LoraRegistry,
    /// Adapters read from disk since the start (`lora_adapter_loads_total`, per manager).
    reads: u64,
    /// Logs of refusals for a full tenant's share, at most one line a second.
    share_refusals: super::admission::Throttle,
}

impl LoraManager {
    /// A manager with no adapters, publishing to `registry`.
    pub fn new(config: LoraManagerConfig, registry: LoraRegistry) -> Self {
        *registry.0.shares.write() = config.tenant_shares.iter().cloned().collect();
        LoraManager {
            config,
            fingerprints: HashMap::new(),
            next_id: 1,
            registry,
            reads: 0,
            share_refusals: super::admission::Throttle::new(super::admission::REFUSAL_LOG_INTERVAL),
        }
    }

    fn publish(&self) {
        let registered = self.registry.0.state.read().adapters.len();
        metrics::gauge!(crate::metric_names::LORA_ADAPTERS).set(registered as f64);
    }

    fn check_name(&self, name: &str) -> Result<(), LoraError> {
        check_name(name, &self.config.base_name)
    }

    fn load(&mut self, path: &Path) -> Result<Arc<LoraAdapter>, LoraError> {
        let t0 = std::time::Instant::now();
        self.reads += 1;
        let adapter = LoraAdapter::load(path, &self.config.model, &self.config.limits)?;
        metrics::counter!(crate::metric_names::LORA_LOADS).increment(1);
        tracing::info!(
            path = %path.display(),
            rank = adapter.rank(),
            bytes = adapter.bytes(),
            ms = t0.elapsed().as_millis() as u64,
            "LoRA adapter loaded"
        );
        Ok(Arc::new(adapter))
    }

    /// Puts `adapter` in memory under `name` and `id`, charged to `owner`.
    fn make_resident(
        &self,
        name: &str,
        id: u32,
        adapter: Arc<LoraAdapter>,
        owner: Option<Arc<str>>,
    ) {
        let resident = Resident {
            id,
            adapter,
            last_used: AtomicU64::new(self.registry.tick()),
            owner,
        };
        let old = self
            .registry
            .0
            .state
            .write()
            .resident
            .insert(name.to_owned(), resident);
        // Weights are freed outside the lock (none are replaced: the manager checks first).
        drop(old);
    }

    /// Registers `name` at `path`, loading the adapter to check it (not pinned).
    #[cfg(test)]
    pub fn register(&mut self, name: &str, path: &Path) -> Result<AdapterInfo, LoraError> {
        self.register_as(name, path, false, false)
    }

    /// Registers `name` at `path`, pinned in memory or not.
    pub fn register_pinned(
        &mut self,
        name: &str,
        path: &Path,
        pinned: bool,
    ) -> Result<AdapterInfo, LoraError> {
        self.register_as(name, path, false, pinned)
    }

    /// Registers `name` at `path`, found in a directory (`discovered`) or not.
    fn register_as(
        &mut self,
        name: &str,
        path: &Path,
        discovered: bool,
        pinned: bool,
    ) -> Result<AdapterInfo, LoraError> {
        self.register_held(name, path, discovered, pinned, Keep::Nobody, None)
            .map(|(info, _)| info)
    }

    /// [`Self::register_as`], the weights kept from the eviction that follows the
    /// registration as `hold` says (and returned with [`Keep::Caller`]): a request that
    /// registers an adapter (found in a directory) gets these weights even when memory is full
    /// of adapters in use, where the eviction would otherwise drop the new adapter, the only
    /// one no request holds, at once (and the request read it again). The weights in memory
    /// are charged to `charge`'s tenant, whose share has room made first.
    fn register_held(
        &mut self,
        name: &str,
        path: &Path,
        discovered: bool,
        pinned: bool,
        hold: Keep,
        charge: Option<&Charge>,
    ) -> Result<Registered, LoraError> {
        self.check_name(name)?;
        if self.registry.contains(name) {
            return Err(LoraError::Exists(name.to_owned()));
        }
        // A full registry takes one more when an adapter found in a directory can go for it
        // (found again on its next request): otherwise found adapters, which come and go with
        // the traffic, would keep an operator's adapters out.
        let max = self.config.max_adapters;
        let full = || self.registry.0.state.read().adapters.len() >= max;
        if full() && self.room_victim().is_none() {
            return Err(LoraError::Full(max));
        }
        self.check_pin_room(name, pinned)?;
        self.make_share_room(charge)?;
        let adapter = self.load(path)?;
        // Room made once the adapter loaded, so a refused one unregisters nothing.
        if let Err(LoraError::Busy(..)) = self.make_room(name) {
            return Err(LoraError::Full(max));
        }
        let (base_model, base_model_differs) = self.base_model_of(name, path, &adapter);
        let info = AdapterInfo {
            name: name.to_owned(),
            id: self.fresh_id(),
            path: path.to_path_buf(),
            rank: adapter.rank(),
            discovered,
            pinned,
            base_model,
            base_model_differs,
        };
        self.fingerprints
            .insert(name.to_owned(), adapter.fingerprint());
        // Listed and in memory at once: no reader sees a registered name without its weights.
        let held = (hold == Keep::Caller).then(|| adapter.clone());
        let resident = Resident {
            id: info.id,
            adapter,
            last_used: AtomicU64::new(self.registry.tick()),
            owner: charge.map(|c| c.tenant.clone()),
        };
        {
            let mut state = self.registry.0.state.write();
            state.adapters.push(info.clone());
            state.resident.insert(name.to_owned(), resident);
        }
        self.evict();
        self.publish();
        tracing::info!(
            name,
            id = info.id,
            discovered,
            pinned,
            "LoRA adapter registered"
        );
        Ok((info, held))
    }

    /// `adapter`'s base model as its `adapter_config.json` names it, and whether that names
    /// another model than the one served ([`names_served_model`]), logged then: served all
    /// the same, as vLLM serves it (the shapes fit; names differ across mirrors and paths).
    fn base_model_of(
        &self,
        name: &str,
        path: &Path,
        adapter: &LoraAdapter,
    ) -> (Option<String>, bool) {
        let Some(base) = adapter.base_model() else {
            return (None, false);
        };
        let differs = !names_served_model(base, &self.config.model_names);
        if differs {
            tracing::warn!(
                name,
                path = %path.display(),
                adapter_base_model = base,
                served_model = %self.config.model_names.join(", "),
                "LoRA adapter's adapter_config.json names another base model \
                 (base_model_name_or_path) than the one served; it fits the served model's \
                 shapes and is served, but may not have been trained on it"
            );
        }
        (Some(base.to_owned()), differs)
    }

    /// Refuses to pin `name` (when `pinned`) if as many other adapters as may be kept in
    /// memory are pinned already.
    fn check_pin_room(&self, name: &str, pinned: bool) -> Result<(), LoraError> {
        if !pinned {
            return Ok(());
        }
        let others = self
            .registry
            .0
            .state
            .read()
            .adapters
            .iter()
            .filter(|a| a.pinned && a.name != name)
            .count();
        if others >= self.config.max_loaded {
            return Err(LoraError::PinLimit(others));
        }
        Ok(())
    }

    /// Pins `name` in memory (loading it now if it was evicted) or unpins it (then it is
    /// evicted as any other when memory is short).
    pub fn set_pinned(&mut self, name: &str, pinned: bool) -> Result<AdapterInfo, LoraError> {
        let info = self
            .registry
            .info(name)
            .ok_or_else(|| LoraError::Unknown(name.to_owned()))?;
        if info.pinned == pinned {
            return Ok(info);
        }
        self.check_pin_room(name, pinned)?;
        if pinned && matches!(self.registry.lookup(name), Lookup::Evicted) {
            self.reload(name, None)?;
        }
        let info = {
            let mut state = self.registry.0.state.write();
            let a = state
                .adapters
                .iter_mut()
                .find(|a| a.name == name)
                .ok_or_else(|| LoraError::Unknown(name.to_owned()))?;
            a.pinned = pinned;
            a.clone()
        };
        self.evict();
        tracing::info!(name, pinned, "LoRA adapter pinning changed");
        Ok(info)
    }

    /// Whether requests may name `name`: registered, or held by one of `adapter_dirs` now
    /// ([`LoraHandle::find`]'s test, run here in tests); nothing is read or registered.
    #[cfg(test)]
    pub fn find(&mut self, name: &str) -> Result<bool, LoraError> {
        Ok(self.registry.contains(name)
            || locate(&self.config.adapter_dirs, name, &self.config.base_name).is_some())
    }

    /// The adapter in `<dir>/<name>/` of the first of `adapter_dirs` that holds one, for a
    /// name not registered: registered now, its weights kept as `hold` says
    /// ([`Self::register_held`]).
    fn discover(
        &mut self,
        name: &str,
        hold: Keep,
        charge: Option<&Charge>,
    ) -> Result<Option<Registered>, LoraError> {
        // A name no registration could take is no directory's either: it is one path
        // segment, never `.` or `..`, before it is joined to a directory.
        let Some(path) = locate(&self.config.adapter_dirs, name, &self.config.base_name) else {
            return Ok(None);
        };
        // Room is made (another found adapter unregistered) only once this one has loaded:
        // a request naming a broken adapter unregisters nothing.
        match self.register_held(name, &path, true, false, hold, charge) {
            Ok(found) => Ok(Some(found)),
            Err(LoraError::Full(max)) => Err(LoraError::Busy(name.to_owned(), max)),
            Err(LoraError::Load(e)) => {
                tracing::warn!(
                    name,
                    path = %path.display(),
                    error = %e,
                    "LoRA adapter found in lora.adapter_dirs could not be loaded; its requests \
                     fail until its files are fixed"
                );
                Err(LoraError::Reload(name.to_owned()))
            }
            Err(e) => Err(e),
        }
    }

    /// Unregisters discovered adapters no request holds, least recently used first (those
    /// not in memory before any in memory), until one more registration fits; `Busy` when
    /// none can go.
    fn make_room(&mut self, name: &str) -> Result<(), LoraError> {
        let max = self.config.max_adapters;
        loop {
            // Chosen and unregistered under one write lock: requests clone an adapter's weights
            // only under the read lock, so none can start using the victim in between (it
            // would run on weights no longer registered, outside the memory accounting).
            let (victim, dropped) = {
                let mut state = self.registry.0.state.write();
                if state.adapters.len() < max {
                    return Ok(());
                }
                let Some(victim) = Self::room_victim_in(&state) else {
                    return Err(LoraError::Busy(name.to_owned(), max));
                };
                let dropped = state.remove(&victim).flatten();
                (victim, dropped)
            };
            self.forget(&victim, dropped);
            tracing::info!(
                name = %victim,
                "LoRA adapter found in a directory unregistered to make room for another"
            );
        }
    }

    /// The discovered adapter [`Self::make_room`] unregisters next: the least recently used
    /// one no request holds, those not in memory first; never a pinned one (an operator
    /// pinned it, through the configuration file's entry for its directory).
    fn room_victim(&self) -> Option<String> {
        Self::room_victim_in(&self.registry.0.state.read())
    }

    /// [`Self::room_victim`] in a locked `state`.
    fn room_victim_in(state: &RegistryState) -> Option<String> {
        state
            .adapters
            .iter()
            .filter(|a| a.discovered && !a.pinned)
            .filter_map(|a| match state.resident.get(&a.name) {
                None => Some((0, &a.name)),
                Some(r) if Arc::strong_count(&r.adapter) == 1 => {
                    Some((r.last_used.load(Ordering::Relaxed), &a.name))
                }
                Some(_) => None,
            })
            .min_by_key(|(used, _)| *used)
            .map(|(_, name)| name.clone())
    }

    /// Serves the adapter at `path` under `name` in place of the one registered under it, if
    /// any (vLLM's `load_inplace`; a name not registered is registered as [`Self::register`]
    /// does). The new adapter is loaded first: if it does not load, the old one stays served
    /// and nothing changes. Then, under one write lock, the name points at the new weights, so
    /// no request ever finds the name missing; requests already running finish with the old
    /// weights, which they hold. Other weights get a fresh id (a new prefix-cache key); the
    /// same weights (an unchanged fingerprint) keep theirs, and their cached blocks.
    #[cfg(test)]
    pub fn replace(&mut self, name: &str, path: &Path) -> Result<AdapterInfo, LoraError> {
        self.replace_pinned(name, path, false)
    }

    /// [`LoraManager::replace`], the new adapter pinned in memory or not.
    pub fn replace_pinned(
        &mut self,
        name: &str,
        path: &Path,
        pinned: bool,
    ) -> Result<AdapterInfo, LoraError> {
        self.check_name(name)?;
        let Some(old) = self.registry.info(name) else {
            return self.register_pinned(name, path, pinned);
        };
        self.check_pin_room(name, pinned)?;
        let adapter = self.load(path)?;
        let fingerprint = adapter.fingerprint();
        let id = if self.fingerprints.get(name) == Some(&fingerprint) {
            old.id
        } else {
            self.fresh_id()
        };
        let (base_model, base_model_differs) = self.base_model_of(name, path, &adapter);
        let info = AdapterInfo {
            name: name.to_owned(),
            id,
            path: path.to_path_buf(),
            rank: adapter.rank(),
            // An admin's from now on, never unregistered to make room.
            discovered: false,
            pinned,
            base_model,
            base_model_differs,
        };
        let resident = Resident {
            id,
            adapter,
            last_used: AtomicU64::new(self.registry.tick()),
            owner: None,
        };
        let replaced = {
            let mut state = self.registry.0.state.write();
            if let Some(a) = state.adapters.iter_mut().find(|a| a.name == name) {
                *a = info.clone();
            }
            state.resident.insert(name.to_owned(), resident)
        };
        // The old weights go (unless a request holds them) outside the lock.
        drop(replaced);
        self.fingerprints.insert(name.to_owned(), fingerprint);
        self.evict();
        self.publish();
        tracing::info!(
            name,
            old_id = old.id,
            id,
            from = %old.path.display(),
            to = %path.display(),
            "LoRA adapter replaced in place"
        );
        Ok(info)
    }

    /// An id no registration has had.
    fn fresh_id(&mut self) -> u32 {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1).max(1);
        id
    }

    /// Forgets `name`; requests already using it finish with its weights.
    pub fn unregister(&mut self, name: &str) -> Result<(), LoraError> {
        let dropped = self
            .registry
            .0
            .state
            .write()
            .remove(name)
            .ok_or_else(|| LoraError::Unknown(name.to_owned()))?;
        self.forget(name, dropped);
        tracing::info!(name, "LoRA adapter unregistered");
        Ok(())
    }

    /// What follows a registration's removal from the registry ([`RegistryState::remove`]):
    /// its weights go (unless a request holds them), outside the lock, with its fingerprint,
    /// and the new set is published.
    fn forget(&mut self, name: &str, dropped: Option<Resident>) {
        drop(dropped);
        self.fingerprints.remove(name);
        self.publish();
    }

    /// The id and weights of `name`, loading them if they were evicted (uncharged).
    #[cfg(test)]
    pub fn resolve(&mut self, name: &str) -> Result<(u32, Arc<LoraAdapter>), LoraError> {
        self.resolve_for(name, None)
    }

    /// The id and weights of `name` for a request, loading them, charged to `charge`'s
    /// tenant, if they are not in memory.
    pub fn resolve_for(
        &mut self,
        name: &str,
        charge: Option<&Charge>,
    ) -> Result<(u32, Arc<LoraAdapter>), LoraError> {
        let resolved = match self.registry.lookup(name) {
            Lookup::Resident(id, adapter) => Ok((id, adapter)),
            Lookup::Evicted => self.reload(name, charge),
            // Registered just now, with the weights held: the eviction that followed the
            // registration could not drop them.
            Lookup::Unknown => match self.discover(name, Keep::Caller, charge) {
                Ok(Some((info, Some(adapter)))) => Ok((info.id, adapter)),
                Ok(Some((_, None)) | None) => Err(LoraError::Unknown(name.to_owned())),
                Err(e) => Err(e),
            },
        };
        self.evict();
        resolved
    }

    /// Loads an evicted adapter again, charged to `charge`'s tenant (room made in its share
    /// first). Its files are the server's, not the client's: a failure is logged with its
    /// detail and reported without it.
    fn reload(
        &mut self,
        name: &str,
        charge: Option<&Charge>,
    ) -> Result<(u32, Arc<LoraAdapter>), LoraError> {
        let info = self
            .registry
            .info(name)
            .ok_or_else(|| LoraError::Unknown(name.to_owned()))?;
        // A pinned adapter is no tenant's (reloaded when pinned).
        let charge = charge.filter(|_| !info.pinned);
        self.make_share_room(charge)?;
        let adapter = match self.load(&info.path) {
            Ok(adapter) => adapter,
            Err(e) if info.discovered => {
                // Found in a directory, so found again (or not) as the directory now says.
                let gone = !holds_adapter(&info.path);
                tracing::warn!(
                    name,
                    path = %info.path.display(),
                    error = %e,
                    "LoRA adapter found in lora.adapter_dirs could not be loaded again; \
                     unregistered"
                );
                self.unregister(name)?;
                return Err(if gone {
                    LoraError::Unknown(name.to_owned())
                } else {
                    LoraError::Reload(name.to_owned())
                });
            }
            Err(e) => {
                tracing::warn!(
                    name,
                    path = %info.path.display(),
                    error = %e,
                    "LoRA adapter could not be loaded again; its requests fail until its files \
                     are restored or it is unloaded"
                );
                return Err(LoraError::Reload(name.to_owned()));
            }
        };
        let mut id = info.id;
        if self.fingerprints.get(name) != Some(&adapter.fingerprint()) {
            // The files changed since they were loaded: other weights, so another prefix-cache
            // key (blocks cached under the old id are never reused).
            id = self.fresh_id();
            tracing::warn!(
                name,
                old_id = info.id,
                new_id = id,
                "LoRA adapter files changed since they were loaded; serving the new weights under a new id"
            );
            self.fingerprints
                .insert(name.to_owned(), adapter.fingerprint());
            let (base_model, differs) = self.base_model_of(name, &info.path, &adapter);
            let mut state = self.registry.0.state.write();
            if let Some(a) = state.adapters.iter_mut().find(|a| a.name == name) {
                a.id = id;
                a.rank = adapter.rank();
                a.base_model = base_model;
                a.base_model_differs = differs;
            }
        }
        self.make_resident(name, id, adapter.clone(), charge.map(|c| c.tenant.clone()));
        Ok((id, adapter))
    }

    /// Makes room for one more adapter in the share of memory of `charge`'s tenant (its
    /// tier's `max_cpu_loras_per_tenant`; nothing without a charge or a share): while the
    /// adapters charged to it (pinned ones aside) fill the share, its least recently used one
    /// that no request holds is dropped; when every one is in use, the load is refused
    /// ([`LoraError::TenantShare`]). Never another tenant's adapter.
    fn make_share_room(&mut self, charge: Option<&Charge>) -> Result<(), LoraError> {
        let Some(charge) = charge else {
            return Ok(());
        };
        let Some(limit) = self.registry.0.shares.read().get(&*charge.tier).copied() else {
            return Ok(());
        };
        let labels = crate::metric_names::tier_labels(&charge.tier);
        loop {
            let dropped = {
                // Chosen and dropped under one write lock: readers clone weights only under
                // the read lock, so none can take up the victim in between.
                let mut state = self.registry.0.state.write();
                let pinned: Vec<&str> = state
                    .adapters
                    .iter()
                    .filter(|a| a.pinned)
                    .map(|a| a.name.as_str())
                    .collect();
                let theirs = state.resident.iter().filter(|(name, r)| {
                    r.owner.as_deref() == Some(&*charge.tenant) && !pinned.contains(&name.as_str())
                });
                let charged = theirs.clone().count();
                if charged < limit {
                    return Ok(());
                }
                let victim = theirs
                    .filter(|(_, r)| Arc::strong_count(&r.adapter) == 1)
                    .min_by_key(|(_, r)| r.last_used.load(Ordering::Relaxed))
                    .map(|(name, _)| name.clone());
                let Some(victim) = victim else {
                    drop(state);
                    metrics::counter!(crate::metric_names::LORA_SHARE_REFUSALS, labels.clone())
                        .increment(1);
                    if let Some(refused) = self.share_refusals.hit(std::time::Instant::now()) {
                        tracing::warn!(
                            tier = %charge.tier,
                            latest_tenant = %charge.tenant,
                            limit,
                            refused,
                            "requests refused (429): their tenant's LoRA adapters in memory \
                             fill its tier's tiers.<name>.max_cpu_loras_per_tenant and all are \
                             in use (refused counts the refusals since the previous such line)"
                        );
                    }
                    return Err(LoraError::TenantShare {
                        tier: charge.tier.to_string(),
                        limit,
                    });
                };
                tracing::debug!(name = %victim, tenant = %charge.tenant,
                    "LoRA adapter evicted from memory to make room in its tenant's share");
                state.resident.remove(&victim)
            };
            metrics::counter!(crate::metric_names::LORA_SHARE_EVICTIONS, labels.clone())
                .increment(1);
            // The weights are freed outside the lock.
            drop(dropped);
        }
    }

    /// Drops least recently used adapters that no request holds while more than `max_loaded`
    /// are in memory; flags the registry when adapters in use keep it over the limit.
    fn evict(&mut self) {
        let max = self.config.max_loaded;
        let shared = &self.registry.0;
        if shared.state.read().resident.len() <= max {
            shared.over_limit.store(false, Ordering::Release);
            return;
        }
        let mut dropped = Vec::new();
        let mut state = shared.state.write();
        let pinned: Vec<String> = state
            .adapters
            .iter()
            .filter(|a| a.pinned)
            .map(|a| a.name.clone())
            .collect();
        while state.resident.len() > max {
            // Only the registry holds an unused adapter's weights; readers clone them only
            // under the read lock, so none can start using a victim while this lock is held.
            let victim = state
                .resident
                .iter()
                .filter(|(name, r)| Arc::strong_count(&r.adapter) == 1 && !pinned.contains(name))
                .min_by_key(|(_, r)| r.last_used.load(Ordering::Relaxed))
                .map(|(name, _)| name.clone());
            let Some(name) = victim else { break };
            tracing::debug!(name = %name, "LoRA adapter evicted from memory");
            dropped.extend(state.resident.remove(&name));
        }
        shared
            .over_limit
            .store(state.resident.len() > max, Ordering::Release);
        drop(state);
        // The weights are freed outside the lock.
        drop(dropped);
    }

    /// Names of the adapters held in memory, in registration order.
    #[cfg(test)]
    fn loaded(&self) -> Vec<String> {
        let state = self.registry.0.state.read();
        state
            .adapters
            .iter()
            .filter(|a| state.resident.contains_key(&a.name))
            .map(|a| a.name.clone())
            .collect()
    }
}

impl Actor for LoraManager {
    type Context = SyncContext<Self>;
}

/// Registers an adapter.
#[derive(Message)]
#[rtype(result = "Result<AdapterInfo, LoraError>")]
pub struct Register {
    /// The name requests will use.
    pub name: String,
    /// The adapter's directory.
    pub path: PathBuf,
    /// Kept in memory while registered.
    pub pinned: bool,
}

impl Handler<Register> for LoraManager {
    type Result = Result<AdapterInfo, LoraError>;
    fn handle(&mut self, msg: Register, _: &mut Self::Context) -> Self::Result {
        self.register_pinned(&msg.name, &msg.path, msg.pinned)
    }
}

/// Pins an adapter in memory or unpins it ([`LoraManager::set_pinned`]).
#[derive(Message)]
#[rtype(result = "Result<AdapterInfo, LoraError>")]
pub struct SetPinned {
    /// The adapter's name.
    pub name: String,
    /// Pinned or not.
    pub pinned: bool,
}

impl Handler<SetPinned> for LoraManager {
    type Result = Result<AdapterInfo, LoraError>;
    fn handle(&mut self, msg: SetPinned, _: &mut Self::Context) -> Self::Result {
        self.set_pinned(&msg.name, msg.pinned)
    }
}

/// Serves an adapter in place of the one registered under its name ([`LoraManager::replace`]).
#[derive(Message)]
#[rtype(result = "Result<AdapterInfo, LoraError>")]
pub struct Replace {
    /// The name requests use.
    pub name: String,
    /// The new adapter's directory.
    pub path: PathBuf,
    /// Kept in memory while registered.
    pub pinned: bool,
}

impl Handler<Replace> for LoraManager {
    type Result = Result<AdapterInfo, LoraError>;
    fn handle(&mut self, msg: Replace, _: &mut Self::Context) -> Self::Result {
        self.replace_pinned(&msg.name, &msg.path, msg.pinned)
    }
}

/// Unregisters an adapter.
#[derive(Message)]
#[rtype(result = "Result<(), LoraError>")]
pub struct Unregister(pub String);

impl Handler<Unregister> for LoraManager {
    type Result = Result<(), LoraError>;
    fn handle(&mut self, msg: Unregister, _: &mut Self::Context) -> Self::Result {
        self.unregister(&msg.0)
    }
}

/// Resolves an adapter name for a request (one the registry did not have in memory).
#[derive(Message)]
#[rtype(result = "Result<(u32, Arc<LoraAdapter>), LoraError>")]
struct Resolve(String, Option<Charge>);

impl Handler<Resolve> for LoraManager {
    type Result = Result<(u32, Arc<LoraAdapter>), LoraError>;
    fn handle(&mut self, msg: Resolve, _: &mut Self::Context) -> Self::Result {
        self.resolve_for(&msg.0, msg.1.as_ref())
    }
}

/// Drops what adapters no request holds any more beyond `max_loaded`.
#[derive(Message)]
#[rtype(result = "()")]
struct Evict;

impl Handler<Evict> for LoraManager {
    type Result = ();
    fn handle(&mut self, _: Evict, _: &mut Self::Context) {
        self.evict();
    }
}

/// Keeps the manager's thread busy until the sender side sends (or is dropped).
#[cfg(test)]
#[derive(Message)]
#[rtype(result = "()")]
struct Hold(std::sync::mpsc::Receiver<()>);

#[cfg(test)]
impl Handler<Hold> for LoraManager {
    type Result = ();
    fn handle(&mut self, msg: Hold, _: &mut Self::Context) {
        let _ = msg.0.recv();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../gpu/tests/fixtures/lora/smollm2-r4")
    }

    fn config(max_adapters: usize, max_loaded: usize) -> LoraManagerConfig {
        LoraManagerConfig {
            model: LlamaConfig::smollm2_135m(),
            base_name: "base".into(),
            limits: LoraLimits::default(),
            max_adapters,
            max_loaded,
            adapter_dirs: Vec::new(),
            model_names: Vec::new(),
            tenant_shares: Vec::new(),
        }
    }

    fn manager(max_adapters: usize, max_loaded: usize) -> LoraManager {
        LoraManager::new(config(max_adapters, max_loaded), LoraRegistry::default())
    }

    /// A copy of the test adapter in a directory of its own, removed on drop.
    struct AdapterCopy(PathBuf);

    impl AdapterCopy {
        fn new(tag: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("sy-lora-{tag}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            for f in ["adapter_config.json", "adapter_model.safetensors"] {
                std::fs::copy(fixture().join(f), dir.join(f)).unwrap();
            }
            AdapterCopy(dir)
        }
    }

    impl Drop for AdapterCopy {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// The reason registering `path` gives.
    fn refusal(path: &Path) -> String {
        match manager(2, 2).register("x", path) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("{} registered", path.display()),
        }
    }

    /// A path that is a file, a device, or a directory whose `adapter_config.json` is a FIFO or
    /// a link to a device was refused as "no adapter_config.json in the directory"; the refusal
    /// stays (nothing of the kind is opened), the message says what is wrong.
    #[test]
    fn adapter_paths_that_are_no_directory_or_hold_no_regular_file_say_so() {
        let cases = |dir: &Path| {
            vec![
                (fixture().join("adapter_config.json"), "is not a directory"),
                (PathBuf::from("/dev/zero"), "is not a directory"),
                (dir.join("missing"), "does not exist"),
                (
                    dir.join("fifo"),
                    "adapter_config.json is not a regular file",
                ),
                (
                    dir.join("device"),
                    "adapter_config.json is not a regular file",
                ),
                (
                    dir.join("subdir"),
                    "adapter_config.json is not a regular file",
                ),
                (dir.join("empty"), "no adapter_config.json in the directory"),
            ]
        };
        let root = AdapterCopy::new("paths");
        for d in ["fifo", "device", "subdir", "empty"] {
            std::fs::create_dir_all(root.0.join(d)).unwrap();
        }
        let fifo = root.0.join("fifo/adapter_config.json");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        std::os::unix::fs::symlink("/dev/zero", root.0.join("device/adapter_config.json")).unwrap();
        std::fs::create_dir_all(root.0.join("subdir/adapter_config.json")).unwrap();
        for (path, says) in cases(&root.0) {
            let reason = refusal(&path);
            assert!(reason.contains(says), "{}: {reason}", path.display());
        }
    }

    /// A copy of the test adapter whose `adapter_config.json` has `fields` set, registered; the
    /// copy is returned so that it outlives the check.
    fn with_config(
        tag: &str,
        fields: serde_json::Value,
    ) -> (AdapterCopy, Result<Arc<LoraAdapter>, String>) {
        let copy = AdapterCopy::new(tag);
        let file = copy.0.join("adapter_config.json");
        let mut config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
        for (k, v) in fields.as_object().unwrap() {
            config[k] = v.clone();
        }
        std::fs::write(&file, config.to_string()).unwrap();
        let mut m = manager(2, 2);
        let loaded = m
            .register("x", &copy.0)
            .map_err(|e| e.to_string())
            .and_then(|_| m.resolve("x").map(|(_, a)| a).map_err(|e| e.to_string()));
        (copy, loaded)
    }

    /// The test adapter adapts all seven projections of every layer. An `adapter_config.json`
    /// that selects fewer (`target_modules`, `layers_to_transform`) was loaded with every
    /// tensor applied; PEFT builds only the selected modules, so only those are applied.
    #[test]
    fn only_the_modules_adapter_config_selects_are_applied_as_peft_does() {
        use switchyard_gpu::LoraTarget::{self, *};
        let targets = |fields: serde_json::Value| -> Vec<LoraTarget> {
            let (_copy, adapter) = with_config("targets", fields.clone());
            adapter
                .unwrap_or_else(|e| panic!("{fields}: {e}"))
                .targets()
        };
        assert_eq!(targets(serde_json::json!({})), LoraTarget::ALL);
        assert_eq!(
            targets(serde_json::json!({"target_modules": ["q_proj", "v_proj"]})),
            [Q, V]
        );
        assert_eq!(
            targets(serde_json::json!({"target_modules": "all-linear"})),
            LoraTarget::ALL
        );
        assert_eq!(
            targets(serde_json::json!({"target_modules": ".*\\.mlp\\.(up|down)_proj"})),
            [Up, Down]
        );
        let (_copy, adapter) = with_config(
            "layers",
            serde_json::json!({"target_modules": ["q_proj"], "layers_to_transform": [0, 2]}),
        );
        let adapter = adapter.unwrap();
        assert_eq!(adapter.targets(), [Q]);
        let layers: Vec<bool> = (0..4).map(|l| adapter.pair(l, Q).is_some()).collect();
        assert_eq!(layers, [true, false, true, false]);
        let (_copy, refused) =
            with_config("none", serde_json::json!({"target_modules": ["lm_head"]}));
        let reason = refused.err().unwrap();
        assert!(reason.contains("select none of its tensors"), "{reason}");
        let (_copy, refused) = with_config(
            "regex-layers",
            serde_json::json!({"target_modules": ".*q_proj", "layers_to_transform": 1}),
        );
        let reason = refused.err().unwrap();
        assert!(
            reason.contains("layers_to_transform cannot be used"),
            "{reason}"
        );
    }

    #[test]
    fn registrations_get_fresh_ids_and_names_are_checked() {
        let mut m = manager(3, 3);
        let a = m.register("a", &fixture()).expect("a");
        let taken = m.register("a", &fixture()).expect_err("the name is taken");
        assert!(matches!(taken, LoraError::Exists(_)));
        // The refusal names the way to replace it (it said only "unload it first").
        assert!(
            taken.to_string().contains("\"load_inplace\": true"),
            "{taken}"
        );
        // `..`, `/`, spaces and percent signs were accepted, and some could then not be
        // unloaded with ordinary clients (curl resolves `..`; `/` needs `%2F`).
        for bad in [
            "",
            "base",
            "x\ny",
            &"n".repeat(switchyard_config::MAX_ADAPTER_NAME + 1),
            "..",
            ".",
            "a/b",
            "a b",
            "a%2Fb",
            " a",
            "a ",
        ] {
            assert!(
                matches!(m.register(bad, &fixture()), Err(LoraError::BadName(_))),
                "{bad:?}"
            );
        }
        assert!(matches!(
            m.register("missing", Path::new("/nonexistent/adapter")),
            Err(LoraError::Load(_))
        ));
        assert!(m.registry.contains("a") && !m.registry.contains("missing"));
        m.unregister("a").expect("unregister");
        assert!(matches!(m.resolve("a"), Err(LoraError::Unknown(_))));
        assert!(!m.registry.contains("a"));
        let again = m.register("a", &fixture()).expect("a again");
        assert_ne!(
            a.id, again.id,
            "a new registration is a new prefix-cache key"
        );
        assert_eq!(m.registry.list(), vec![again]);
    }

    #[test]
    fn the_registry_is_bounded() {
        let mut m = manager(2, 2);
        m.register("a", &fixture()).expect("a");
        m.register("b", &fixture()).expect("b");
        assert!(matches!(
            m.register("c", &fixture()),
            Err(LoraError::Full(2))
        ));
    }

    #[test]
    fn unused_adapters_are_evicted_least_recently_used_first_and_reloaded() {
        let mut m = manager(4, 1);
        m.register("a", &fixture()).expect("a");
        m.register("b", &fixture()).expect("b");
        assert_eq!(m.loaded(), ["b"]);
        // A request holds a's weights: a stays loaded past the limit while held.
        let (id_a, held) = m.resolve("a").expect("a");
        assert_eq!(m.loaded(), ["a"]);
        let (_, b) = m.resolve("b").expect("b");
        assert_eq!(m.loaded(), ["a", "b"]);
        drop(b);
        m.register("c", &fixture()).expect("c");
        assert_eq!(m.loaded(), ["a"], "b and c unused, a held");
        drop(held);
        let (id, _) = m.resolve("a").expect("a");
        assert_eq!(id, id_a);
        // Unregistering a held adapter leaves the holder's weights alone.
        let (_, c) = m.resolve("c").expect("c");
        m.unregister("c").expect("unregister");
        assert!(c.rank() == 4);
    }

    #[test]
    fn a_pinned_adapter_stays_in_memory_and_pins_are_bounded_by_what_memory_keeps() {
        let mut m = manager(8, 2);
        let p = m.register_pinned("p", &fixture(), true).expect("p");
        assert!(p.pinned);
        m.register("a", &fixture()).expect("a");
        m.register("b", &fixture()).expect("b");
        // Two kept in memory: the pinned one and the most recent; a went, p never does.
        assert_eq!(m.loaded(), ["p", "b"]);
        m.resolve("a").expect("a");
        assert_eq!(m.loaded(), ["p", "a"]);
        // A second pin fits (two kept in memory), a third does not, whichever way it comes.
        m.set_pinned("b", true).expect("b pinned, loaded again");
        assert_eq!(m.loaded(), ["p", "b"]);
        assert!(matches!(
            m.register_pinned("c", &fixture(), true),
            Err(LoraError::PinLimit(2))
        ));
        assert!(!m.registry.contains("c"));
        assert!(matches!(
            m.set_pinned("a", true),
            Err(LoraError::PinLimit(2))
        ));
        assert!(matches!(
            m.replace_pinned("a", &fixture(), true),
            Err(LoraError::PinLimit(2))
        ));
        // Replacing a pinned adapter may keep its pin; unpinned, it goes as any other.
        assert!(m.replace_pinned("b", &fixture(), true).expect("b").pinned);
        let b = m.set_pinned("b", false).expect("b unpinned");
        assert!(!b.pinned);
        m.resolve("a").expect("a");
        assert_eq!(m.loaded(), ["p", "a"]);
        let listed: Vec<(String, bool)> = m
            .registry
            .list()
            .into_iter()
            .map(|a| (a.name, a.pinned))
            .collect();
        let want = [("p", true), ("a", false), ("b", false)].map(|(n, p)| (n.to_string(), p));
        assert_eq!(listed, want);
        assert!(matches!(
            m.set_pinned("x", true),
            Err(LoraError::Unknown(_))
        ));
    }

    #[test]
    fn an_adapter_whose_files_changed_while_evicted_comes_back_under_a_new_id() {
        let dir = AdapterCopy::new("changed");
        let mut m = manager(4, 1);
        let a = m.register("a", &dir.0).expect("a");
        m.register("b", &fixture()).expect("b");
        assert_eq!(m.loaded(), ["b"]);
        // Reloaded from unchanged files: the same weights, the same id.
        assert_eq!(m.resolve("a").expect("a").0, a.id);
        m.resolve("b").expect("b");
        assert_eq!(m.loaded(), ["b"]);
        // Reloaded after the files changed (another scale): a new id, listed as such.
        let config = std::fs::read_to_string(dir.0.join("adapter_config.json")).unwrap();
        let changed = config.replace("\"lora_alpha\": 8.0", "\"lora_alpha\": 16.0");
        assert_ne!(changed, config);
        std::fs::write(dir.0.join("adapter_config.json"), changed).unwrap();
        let (id, _) = m.resolve("a").expect("a");
        assert_ne!(
            id, a.id,
            "other weights never share the old id's cached blocks"
        );
        assert!(m
            .registry
            .list()
            .iter()
            .any(|i| i.name == "a" && i.id == id));
    }

    #[test]
    fn a_failed_reload_names_the_adapter_but_not_its_files() {
        let dir = AdapterCopy::new("broken");
        let mut m = manager(4, 1);
        m.register("a", &dir.0).expect("a");
        m.register("b", &fixture()).expect("b");
        std::fs::remove_file(dir.0.join("adapter_model.safetensors")).unwrap();
        let e = m.resolve("a").expect_err("the files are gone");
        assert!(matches!(&e, LoraError::Reload(n) if n == "a"), "{e:?}");
        let message = e.to_string();
        assert_eq!(message, "LoRA adapter 'a' could not be loaded");
        // Still registered; the adapter in memory is untouched.
        assert!(m.registry.contains("a"));
        assert_eq!(m.loaded(), ["b"]);
    }

    /// A manager that looks for adapters in `dirs`.
    fn finder(max_adapters: usize, max_loaded: usize, dirs: &[&Path]) -> LoraManager {
        let mut c = config(max_adapters, max_loaded);
        c.adapter_dirs = dirs.iter().map(|d| d.to_path_buf()).collect();
        LoraManager::new(c, LoraRegistry::default())
    }

    /// Copies the test adapter to `root/name`.
    fn copy_into(root: &Path, name: &str) {
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["adapter_config.json", "adapter_model.safetensors"] {
            std::fs::copy(fixture().join(f), dir.join(f)).unwrap();
        }
    }

    /// A request for `name`, an adapter of a directory: resolved (registered and read on the
    /// first), its weights let go at once; its registration.
    fn found(m: &mut LoraManager, name: &str) -> Result<AdapterInfo, LoraError> {
        m.resolve(name)?;
        m.registry
            .info(name)
            .ok_or_else(|| LoraError::Unknown(name.into()))
    }

    #[test]
    fn adapters_in_the_directories_are_found_on_demand() {
        let first = AdapterCopy::new("dirs-first");
        let second = AdapterCopy::new("dirs-second");
        copy_into(&second.0, "found");
        copy_into(&first.0, "both");
        copy_into(&second.0, "both");
        copy_into(&second.0, "taken");
        // A directory without adapter_config.json holds no adapter.
        std::fs::create_dir_all(second.0.join("empty")).unwrap();
        let missing = Path::new("/nonexistent/adapters");
        let mut m = finder(8, 8, &[missing, &first.0, &second.0]);
        m.register("taken", &fixture()).expect("registered");
        // A name check reads and registers nothing; a request does.
        assert!(m.find("found").expect("found"));
        assert!(!m.registry.contains("found") && m.reads == 1);
        let info = found(&mut m, "found").unwrap();
        assert!(info.discovered && info.path == second.0.join("found"));
        // The first directory that has it wins; a registration wins over every directory.
        let both = found(&mut m, "both").unwrap();
        assert_eq!(both.path, first.0.join("both"));
        let taken = found(&mut m, "taken").unwrap();
        assert!(!taken.discovered && taken.path == fixture());
        // Names that are no adapter's, or no single path segment, find nothing.
        for name in [
            "nobody",
            "empty",
            "..",
            ".",
            "found/../found",
            "/found",
            "",
            "base",
        ] {
            assert!(!m.find(name).unwrap(), "{name:?}");
            assert!(
                matches!(m.resolve(name), Err(LoraError::Unknown(_))),
                "{name:?}"
            );
        }
        // A request resolves a name it finds, and it is listed from then on.
        copy_into(&first.0, "late");
        let (id, adapter) = m.resolve("late").expect("late");
        assert_eq!(adapter.rank(), 4);
        assert!(m
            .registry
            .list()
            .iter()
            .any(|a| a.name == "late" && a.id == id));
        assert!(matches!(m.resolve("nobody"), Err(LoraError::Unknown(_))));
        // Without directories nothing is found.
        let mut plain = manager(8, 8);
        assert!(!plain.find("found").unwrap());
    }

    #[test]
    fn found_adapters_make_room_for_each_other_but_not_for_adapters_in_use() {
        let root = AdapterCopy::new("room");
        for name in ["d1", "d2", "d3"] {
            copy_into(&root.0, name);
        }
        let mut m = finder(2, 2, &[&root.0]);
        m.register("configured", &fixture()).expect("configured");
        found(&mut m, "d1").unwrap();
        // Full: d1, found and unused, makes room; the configured adapter never does.
        found(&mut m, "d2").unwrap();
        let names = |m: &LoraManager| -> Vec<String> {
            m.registry.list().into_iter().map(|a| a.name).collect()
        };
        assert_eq!(names(&m), ["configured", "d2"]);
        // d2 in use: nothing can go.
        let (_, held) = m.resolve("d2").expect("d2");
        let e = found(&mut m, "d3").expect_err("full of adapters in use");
        assert!(matches!(&e, LoraError::Busy(n, 2) if n == "d3"), "{e:?}");
        assert_eq!(names(&m), ["configured", "d2"]);
        drop(held);
        found(&mut m, "d3").unwrap();
        assert_eq!(names(&m), ["configured", "d3"]);
        // The least recently used goes first, those evicted from memory before any other.
        let mut m = finder(3, 1, &[&root.0]);
        found(&mut m, "d1").unwrap();
        found(&mut m, "d2").unwrap();
        found(&mut m, "d3").unwrap();
        m.resolve("d1").expect("d1");
        copy_into(&root.0, "d4");
        found(&mut m, "d4").unwrap();
        assert_eq!(
            names(&m),
            ["d1", "d3", "d4"],
            "d2, out of memory and older, went"
        );
    }

    /// Regression: a request naming an adapter of a directory while memory held as many
    /// adapters in use as it keeps (`max_loaded`) got a 404 `model_not_found`: the eviction
    /// after the registration dropped the new adapter, the only one no request held, before
    /// the request took its weights, and the request then found it "not in memory".
    #[test]
    fn an_adapter_found_while_memory_is_full_of_adapters_in_use_is_served() {
        let root = AdapterCopy::new("found-full");
        copy_into(&root.0, "d1");
        let mut m = finder(4, 1, &[&root.0]);
        m.register("configured", &fixture()).expect("configured");
        let (_, held) = m.resolve("configured").expect("configured");
        let (id, adapter) = m.resolve("d1").expect("found while memory is full");
        assert_eq!(adapter.rank(), 4);
        assert!(m
            .registry
            .list()
            .iter()
            .any(|a| a.name == "d1" && a.id == id && a.discovered));
        // Both in use: both stay in memory, over the limit, until released.
        assert_eq!(m.loaded(), ["configured", "d1"]);
        drop((held, adapter));
    }

    /// Regression: two requests' name checks of two adapters of a directory, while memory
    /// held as many adapters in use as it keeps (`max_cpu_loras`): each check read its
    /// adapter and kept it for its request in the one reservation slot, the second check
    /// releasing the first's, whose adapter the eviction then dropped, so its request read
    /// it a second time. A check reads nothing; each request reads its adapter once.
    #[test]
    fn two_name_checks_of_found_adapters_while_memory_is_full_read_each_adapter_once() {
        let root = AdapterCopy::new("found-two-checks");
        for name in ["d1", "d2"] {
            copy_into(&root.0, name);
        }
        let mut m = finder(8, 1, &[&root.0]);
        m.register("configured", &fixture()).expect("configured");
        let (_, held) = m.resolve("configured").expect("configured");
        assert!(m.find("d1").unwrap());
        assert!(m.find("d2").unwrap());
        assert_eq!(m.loaded(), ["configured"], "memory over max_cpu_loras");
        let (_, a1) = m.resolve("d1").expect("d1");
        let (_, a2) = m.resolve("d2").expect("d2");
        assert_eq!(m.reads, 3, "an adapter read twice");
        // All three in use: all stay; released, memory is back to max_cpu_loras.
        assert_eq!(m.loaded(), ["configured", "d1", "d2"]);
        drop((held, a1, a2));
        m.evict();
        assert_eq!(m.loaded().len(), 1);
        assert_eq!(m.reads, 3);
    }

    /// A tenant's share of adapter memory (`tiers.<name>.max_cpu_loras_per_tenant`): once the
    /// adapters read for it fill the share, its next load drops its own least recently used
    /// adapter that no request holds, never another tenant's; with all of its adapters in
    /// use it is refused and nothing is dropped; an adapter in memory serves it whoever was
    /// charged; a lowered share is applied at the tenant's next load.
    #[test]
    fn a_tenant_s_loads_recycle_its_own_share_and_never_evict_another_tenant_s_adapters() {
        let root = AdapterCopy::new("share");
        for name in ["a1", "a2", "a3", "b1"] {
            copy_into(&root.0, name);
        }
        let mut c = config(16, 8);
        c.adapter_dirs = vec![root.0.clone()];
        c.tenant_shares = vec![("gold".into(), 2)];
        let mut m = LoraManager::new(c, LoraRegistry::default());
        let charge = |tenant: &str| Charge {
            tenant: tenant.into(),
            tier: "gold".into(),
        };
        let (acme, bob) = (charge("acme"), charge("bob"));
        let serve = |m: &mut LoraManager, name: &str, who: &Charge| {
            m.resolve_for(name, Some(who)).map(|(_, a)| a)
        };
        serve(&mut m, "b1", &bob).expect("b1");
        serve(&mut m, "a1", &acme).expect("a1");
        serve(&mut m, "a2", &acme).expect("a2");
        // acme's share is full: its next load drops a1, its least recently used, not b1.
        serve(&mut m, "a3", &acme).expect("a3");
        assert_eq!(m.loaded(), ["b1", "a2", "a3"]);
        // All of acme's adapters in use: refused, nothing dropped or read.
        let held = (serve(&mut m, "a2", &acme), serve(&mut m, "a3", &acme));
        let reads = m.reads;
        let e = serve(&mut m, "a1", &acme).expect_err("share full of adapters in use");
        assert!(
            matches!(&e, LoraError::TenantShare { tier, limit: 2 } if tier == "gold"),
            "{e:?}"
        );
        assert!(
            e.to_string()
                .contains("tiers.gold.max_cpu_loras_per_tenant: 2"),
            "{e}"
        );
        assert_eq!((m.loaded().len(), m.reads), (3, reads));
        // bob's adapter in memory serves acme, uncharged; bob's own loads are not bounded by
        // acme's.
        serve(&mut m, "b1", &acme).expect("b1 for acme");
        serve(&mut m, "a1", &bob).expect("a1 for bob");
        assert_eq!(m.loaded(), ["b1", "a1", "a2", "a3"]);
        drop(held);
        // A share lowered to one (a reload): acme's next load drops both of its adapters.
        *m.registry.0.shares.write() = [("gold".to_string(), 1)].into();
        m.unregister("a1").expect("a1");
        serve(&mut m, "a1", &acme).expect("a1");
        assert_eq!(m.loaded(), ["b1", "a1"]);
        // Without a charge, or in a tier without a share, nothing is bounded.
        serve(
            &mut m,
            "a2",
            &Charge {
                tenant: "acme".into(),
                tier: "free".into(),
            },
        )
        .expect("a2");
        m.resolve("a3").expect("a3");
        assert_eq!(m.loaded(), ["b1", "a2", "a3", "a1"]);
    }

    /// An adapter's `base_model_name_or_path` names the served model when its last path
    /// segment is one of the model's names, or one's stem, by letters and digits without
    /// case; a hub id, a mirror's and a local path of the same model all do.
    #[test]
    fn base_model_names_are_compared_by_their_last_segment() {
        let names = |n: &[&str]| -> Vec<String> { n.iter().map(|s| s.to_string()).collect() };
        let served = names(&[
            "smollm2",
            "SmolLM2 135M Instruct",
            "SmolLM2-135M-Instruct.Q4_1",
        ]);
        for same in [
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            "mirror-org/smollm2-135m-instruct",
            "/srv/models/SmolLM2-135M-Instruct/",
            "C:\\models\\SmolLM2_135M_Instruct",
            "smollm2-135m-instruct",
            "",
            "/",
        ] {
            assert!(names_served_model(same, &served), "{same:?}");
        }
        for other in [
            "HuggingFaceTB/SmolLM2-135M",
            "meta-llama/Llama-3.2-1B",
            "SmolLM2-135M-Instruct-v2",
        ] {
            assert!(!names_served_model(other, &served), "{other:?}");
        }
        assert!(names_served_model("anything", &[]));
    }

    /// An adapter whose `adapter_config.json` names another base model than the one served
    /// is registered and served all the same, its registration saying so; one naming the
    /// served model, or none, says nothing.
    #[test]
    fn an_adapter_for_another_base_model_is_served_and_flagged() {
        let mut c = config(4, 4);
        c.model_names = vec!["smollm2".into(), "SmolLM2-135M-Instruct.Q4_1".into()];
        let mut m = LoraManager::new(c, LoraRegistry::default());
        let same = m.register("same", &fixture()).expect("same");
        assert_eq!(
            same.base_model.as_deref(),
            Some("HuggingFaceTB/SmolLM2-135M-Instruct")
        );
        assert!(!same.base_model_differs);
        let other = AdapterCopy::new("other-base-model");
        let file = other.0.join("adapter_config.json");
        let mut json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
        json["base_model_name_or_path"] = "HuggingFaceTB/SmolLM2-135M".into();
        std::fs::write(&file, json.to_string()).unwrap();
        let info = m.register("other", &other.0).expect("served all the same");
        assert_eq!(
            info.base_model.as_deref(),
            Some("HuggingFaceTB/SmolLM2-135M")
        );
        assert!(info.base_model_differs);
        // Replaced in place by the served model's adapter: no longer flagged.
        let replaced = m.replace("other", &fixture()).expect("replaced");
        assert!(!replaced.base_model_differs);
        json.as_object_mut()
            .unwrap()
            .remove("base_model_name_or_path");
        std::fs::write(&file, json.to_string()).unwrap();
        let none = m.register("none", &other.0).expect("none");
        assert_eq!((none.base_model, none.base_model_differs), (None, false));
    }

    /// Regression: with the registry full of adapters found in directories, `POST
    /// /admin/lora` was refused ("unload one first") although a found adapter no request used
    /// could go, and unloading one only let the next request find it again.
    #[test]
    fn found_adapters_make_room_for_an_operators_adapter_unless_all_are_in_use() {
        let root = AdapterCopy::new("room-admin");
        for name in ["d1", "d2"] {
            copy_into(&root.0, name);
        }
        let mut m = finder(2, 2, &[&root.0]);
        found(&mut m, "d1").unwrap();
        found(&mut m, "d2").unwrap();
        let names = |m: &LoraManager| -> Vec<String> {
            m.registry.list().into_iter().map(|a| a.name).collect()
        };
        // An adapter that does not load unregisters nothing.
        let e = m
            .register("admin", &root.0.join("missing"))
            .expect_err("no such adapter");
        assert!(matches!(e, LoraError::Load(_)), "{e:?}");
        assert_eq!(names(&m), ["d1", "d2"]);
        // d1, the least recently used, makes room.
        m.register("admin", &fixture()).expect("room made");
        assert_eq!(names(&m), ["d2", "admin"]);
        // d2 in use, the others an operator's: full.
        let (_, held) = m.resolve("d2").expect("d2");
        let e = m.register("other", &fixture()).expect_err("full");
        assert!(matches!(e, LoraError::Full(2)), "{e:?}");
        drop(held);
        m.register("other", &fixture()).expect("d2 released");
        assert_eq!(names(&m), ["admin", "other"]);
        let e = m
            .register("third", &fixture())
            .expect_err("no found adapter left");
        assert!(matches!(e, LoraError::Full(2)), "{e:?}");
    }

    /// Regression: room was made before a found adapter was loaded, so each request naming
    /// a broken adapter of a directory unregistered a working one (loaded again on its next
    /// request) and then failed.
    #[test]
    fn a_broken_found_adapter_unregisters_nothing() {
        let root = AdapterCopy::new("room-broken");
        copy_into(&root.0, "d1");
        copy_into(&root.0, "broken");
        std::fs::write(root.0.join("broken/adapter_config.json"), "{not json").unwrap();
        let mut m = finder(2, 2, &[&root.0]);
        m.register("configured", &fixture()).expect("configured");
        found(&mut m, "d1").unwrap();
        let e = m.resolve("broken").expect_err("broken");
        assert!(matches!(&e, LoraError::Reload(n) if n == "broken"), "{e:?}");
        let names: Vec<String> = m.registry.list().into_iter().map(|a| a.name).collect();
        assert_eq!(names, ["configured", "d1"]);
    }

    /// Regression: a found adapter pinned (the configuration file naming its directory
    /// with `pinned: true`, which SIGHUP applies with `set_pinned`) was unregistered to make
    /// room for another registration as any found adapter, so a pinned adapter vanished.
    #[test]
    fn a_pinned_found_adapter_is_never_unregistered_to_make_room() {
        let root = AdapterCopy::new("room-pinned");
        for name in ["d1", "d2"] {
            copy_into(&root.0, name);
        }
        let mut m = finder(2, 2, &[&root.0]);
        found(&mut m, "d1").unwrap();
        found(&mut m, "d2").unwrap();
        // d1, the least recently used, is pinned: d2 goes instead.
        m.set_pinned("d1", true).expect("pinned");
        m.register("admin", &fixture()).expect("room made");
        let names: Vec<String> = m.registry.list().into_iter().map(|a| a.name).collect();
        assert_eq!(names, ["d1", "admin"]);
        let e = m.register("other", &fixture()).expect_err("d1 pinned");
        assert!(matches!(e, LoraError::Full(2)), "{e:?}");
        let e = m.resolve("d2").expect_err("no found adapter may go");
        assert!(matches!(&e, LoraError::Busy(n, 2) if n == "d2"), "{e:?}");
        // Unpinned, it goes as any found adapter.
        m.set_pinned("d1", false).expect("unpinned");
        m.resolve("d2").expect("d1 made room");
        let names: Vec<String> = m.registry.list().into_iter().map(|a| a.name).collect();
        assert_eq!(names, ["admin", "d2"]);
    }

    #[test]
    fn a_found_adapter_whose_files_went_is_found_again_as_its_directory_says() {
        let root = AdapterCopy::new("gone");
        for name in ["d1", "d2", "d3"] {
            copy_into(&root.0, name);
        }
        let mut m = finder(8, 1, &[&root.0]);
        found(&mut m, "d1").unwrap();
        found(&mut m, "d2").unwrap();
        found(&mut m, "d3").unwrap();
        assert_eq!(m.loaded(), ["d3"]);
        // Removed while out of memory: unregistered on its next request, which is a 404's.
        std::fs::remove_dir_all(root.0.join("d1")).unwrap();
        assert!(matches!(m.resolve("d1"), Err(LoraError::Unknown(_))));
        assert!(!m.registry.contains("d1"));
        // Broken: the server's 503, without the path, unregistered, and still refused while
        // its files stay broken.
        std::fs::remove_file(root.0.join("d2/adapter_model.safetensors")).unwrap();
        let e = m.resolve("d2").expect_err("broken");
        assert_eq!(e.to_string(), "LoRA adapter 'd2' could not be loaded");
        assert!(!m.registry.contains("d2"));
        let e = found(&mut m, "d2").expect_err("still broken");
        assert!(matches!(&e, LoraError::Reload(n) if n == "d2"), "{e:?}");
        // Fixed: found again.
        copy_into(&root.0, "d2");
        assert!(found(&mut m, "d2").unwrap().discovered);
    }

    #[actix::test]
    async fn the_handle_finds_adapters_through_the_manager() {
        let root = AdapterCopy::new("handle");
        copy_into(&root.0, "found");
        let mut c = config(4, 4);
        c.adapter_dirs = vec![root.0.clone()];
        let lora = LoraHandle::start(c);
        assert!(!lora.find("nobody").await.unwrap());
        assert!(lora.find("found").await.unwrap());
        let (id, _) = lora.resolve("found", None).await.expect("found");
        let info = lora
            .registry
            .info("found")
            .expect("registered by the request");
        assert!(info.discovered && info.id == id);
        // Resolved directly too, without a find first.
        copy_into(&root.0, "direct");
        lora.resolve("direct", None).await.expect("direct");
        assert!(lora.registry.contains("direct"));
        // Without directories, an unknown name never reaches the manager.
        let plain = LoraHandle::start(config(4, 4));
        copy_into(&root.0, "x");
        assert!(!plain.find("x").await.unwrap());
        assert!(matches!(
            plain.resolve("x", None).await,
            Err(LoraError::Unknown(_))
        ));
    }

    /// The handle lists what the directories hold without the manager (whose thread may be
    /// busy loading) and without registering or loading anything.
    #[actix::test]
    async fn the_handle_lists_the_directories_without_the_manager() {
        let root = AdapterCopy::new("listed");
        copy_into(&root.0, "b");
        copy_into(&root.0, "a");
        let mut c = config(4, 4);
        c.adapter_dirs = vec![root.0.clone()];
        let lora = LoraHandle::start(c);
        let (release, hold) = std::sync::mpsc::channel();
        lora.addr.do_send(Hold(hold));
        assert_eq!(*lora.in_directories().await, ["a", "b"]);
        // A request's name check does not wait for the manager either (it reads nothing).
        assert!(lora.find("a").await.unwrap() && !lora.find("c").await.unwrap());
        release.send(()).unwrap();
        assert!(lora.registry.list().is_empty(), "listing registers nothing");
        assert!(lora.registry.0.state.read().resident.is_empty());
        // Without directories there is nothing to list.
        assert!(LoraHandle::start(config(4, 4))
            .in_directories()
            .await
            .is_empty());
    }

    #[test]
    fn an_adapter_replaced_in_place_is_never_missing_and_a_bad_replacement_changes_nothing() {
        let other = AdapterCopy::new("replace");
        let config = std::fs::read_to_string(other.0.join("adapter_config.json")).unwrap();
        let changed = config.replace("\"lora_alpha\": 8.0", "\"lora_alpha\": 16.0");
        assert_ne!(changed, config);
        std::fs::write(other.0.join("adapter_config.json"), changed).unwrap();
        let mut m = manager(4, 4);
        let first = m.register("a", &fixture()).expect("a");
        let (_, held) = m.resolve("a").expect("a");
        // Other weights: a fresh id, the new path; a request running keeps the old weights.
        let second = m.replace("a", &other.0).expect("replaced");
        assert_ne!(second.id, first.id);
        assert_eq!(second.path, other.0);
        let (id, now) = m.resolve("a").expect("a");
        assert_eq!(id, second.id);
        assert!(
            !Arc::ptr_eq(&held, &now),
            "new requests get the new weights"
        );
        assert_eq!(m.registry.list(), vec![second.clone()]);
        // The same weights again (a copy elsewhere): the id, and its cached blocks, stay.
        let copy = AdapterCopy::new("replace-same");
        std::fs::copy(
            other.0.join("adapter_config.json"),
            copy.0.join("adapter_config.json"),
        )
        .unwrap();
        let third = m.replace("a", &copy.0).expect("same weights");
        assert_eq!(third.id, second.id);
        // A replacement that does not load leaves the adapter served as it was.
        let e = m
            .replace("a", Path::new("/nonexistent/adapter"))
            .expect_err("missing");
        assert!(matches!(e, LoraError::Load(_)), "{e:?}");
        assert_eq!(m.registry.list(), vec![third.clone()]);
        assert_eq!(m.resolve("a").expect("a").0, third.id);
        // A name not registered is registered; a bad name is refused.
        let b = m.replace("b", &fixture()).expect("b");
        assert!(m.registry.contains("b") && b.id != third.id);
        assert!(matches!(
            m.replace("..", &fixture()),
            Err(LoraError::BadName(_))
        ));
        // A found adapter replaced by an admin is the admin's: it never makes room.
        let root = AdapterCopy::new("replace-found");
        copy_into(&root.0, "found");
        let mut m = finder(2, 2, &[&root.0]);
        assert!(found(&mut m, "found").unwrap().discovered);
        assert!(!m.replace("found", &fixture()).unwrap().discovered);
        m.register("c", &fixture()).expect("c");
        copy_into(&root.0, "other");
        assert!(matches!(found(&mut m, "other"), Err(LoraError::Busy(..))));
    }

    /// Polls `fut` once: `Some` with its output if it completes without waiting.
    fn poll_once<F: std::future::Future>(fut: std::pin::Pin<&mut F>) -> Option<F::Output> {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match fut.poll(&mut cx) {
            std::task::Poll::Ready(out) => Some(out),
            std::task::Poll::Pending => None,
        }
    }

    #[actix::test]
    async fn adapters_in_memory_resolve_while_the_manager_is_busy() {
        let lora = LoraHandle::start(config(4, 1));
        let register = |name: &str| Register {
            name: name.into(),
            path: fixture(),
            pinned: false,
        };
        let a = lora.ask(register("a")).await.expect("a");
        let b = lora.ask(register("b")).await.expect("b");
        // The manager's thread is taken (as by an admin load of a large adapter).
        let (release, hold) = std::sync::mpsc::channel();
        lora.addr.do_send(Hold(hold));
        // b is in memory: resolved from the registry, without waiting for the manager.
        let resolve_b = std::pin::pin!(lora.resolve("b", None));
        let (id, _) = poll_once(resolve_b)
            .expect("resolved without the manager")
            .expect("b");
        assert_eq!(id, b.id);
        let unknown = std::pin::pin!(lora.resolve("nobody", None));
        assert!(matches!(
            poll_once(unknown),
            Some(Err(LoraError::Unknown(_)))
        ));
        // a was evicted (max_loaded 1): only its reload waits for the manager.
        let mut resolve_a = std::pin::pin!(lora.resolve("a", None));
        assert!(poll_once(resolve_a.as_mut()).is_none(), "a reload waits");
        release.send(()).unwrap();
        let (id, _) = resolve_a.await.expect("a");
        assert_eq!(id, a.id);
    }

    #[actix::test]
    async fn adapters_released_over_the_limit_are_evicted_on_the_next_request() {
        let lora = LoraHandle::start(config(4, 1));
        let register = |name: &str| Register {
            name: name.into(),
            path: fixture(),
            pinned: false,
        };
        lora.ask(register("a")).await.expect("a");
        let (_, held_a) = lora.resolve("a", None).await.expect("a");
        // b, unused, makes way at once for a, in use.
        lora.ask(register("b")).await.expect("b");
        let in_memory = || lora.registry.0.state.read().resident.len();
        assert_eq!(in_memory(), 1);
        // Reloaded for a request while a is in use: two in memory, over the limit of one.
        let (_, held_b) = lora.resolve("b", None).await.expect("b");
        assert_eq!(in_memory(), 2);
        drop((held_a, held_b));
        // The next request served from memory asks the manager to evict again: a, unused and
        // the least recently used, goes. A message sent after that request's returns once the
        // manager has handled it.
        lora.resolve("b", None).await.expect("b");
        let (release, hold) = std::sync::mpsc::channel();
        release.send(()).unwrap();
        lora.addr.send(Hold(hold)).await.unwrap();
        let state = lora.registry.0.state.read();
        assert_eq!(state.resident.keys().collect::<Vec<_>>(), ["b"]);
    }
}
