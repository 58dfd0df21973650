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
//! kept in memory, those in use and the one being read included; beyond that, the least
//! recently used adapter that no request holds is dropped and loaded again on its next request.
//! The room for a read into full memory is made before the read
//! ([`LoraManager::make_read_room`]), so memory never holds one more while the files are
//! read; and only once the adapter's `adapter_config.json` and the header of its
//! `adapter_model.safetensors` (not its weights) pass a check of everything a load checks but
//! the values ([`LoraAdapter::check`]), so an adapter that a load would refuse for its
//! configuration, its header or its tensors' names, types and shapes drops nothing (its
//! request gets the load's refusal). A read that passes the check and still fails (values
//! that are not finite, files changed in between) leaves its slot free; the adapter dropped
//! for it is read again on its next request. Adapters in use are never dropped, nor are
//! pinned ones (at most `max_loaded` are pinned), so while more than `max_loaded` are in use
//! all of them stay (memory is then bounded by `max_adapters` adapters of at most
//! `max_lora_rank`), and the excess is dropped once they are released: by the manager's next
//! load, or on the next request for an adapter in memory, which asks the manager to evict
//! again. How many different adapters run in one step is the
//! scheduler's limit (`max_loras`).
//!
//! Tenants' shares. An adapter read into memory for a request is charged to the request's
//! tenant ([`Charge`]); an operator's registrations and pinned adapters to no one. A tier may
//! bound what each of its tenants is charged (`tiers.<name>.max_cpu_loras_per_tenant`,
//! [`LoraHandle::set_tenant_shares`]): a load for a tenant whose charged adapters fill its
//! share drops the tenant's own least recently used one that no request holds once the new
//! one has loaded (so a load that fails drops nothing; before the read when memory is full,
//! once the adapter's header passed the check;
//! chosen and dropped under one write lock, as every eviction), and is refused before any
//! read ([`LoraError::TenantShare`], a 429) when the ones the tenant's own requests use fill
//! the share ([`share_fits`]: every one, for a tenant within its share). An adapter of the
//! tenant's that only other tenants' requests use (each request holds an [`AdapterUser`] mark
//! beside the weights, and so does each batch that carries them, until it is recycled: a
//! request that ended during a step uses the adapter until that step is back) is not held
//! against it: its charge moves to one of those tenants (one with room in its share before
//! any of the tenant's own adapters is dropped; with nothing to drop, one beyond its share,
//! whose own loads then make room), so no tenant keeps another out by keeping the other's
//! adapters busy ([`share_step`]). So a tenant naming many adapters recycles its own slots
//! once its share is full and displaces at most its share of the other tenants' adapters; an
//! adapter in memory still serves every tenant, whoever it is charged to, until the tenant
//! charged needs its slot.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use actix::{Actor, Addr, Handler, Message, SyncArbiter, SyncContext};
use parking_lot::{Mutex, RwLock};
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
    /// allows, all in use by its own requests, and its adapter is not in memory.
    #[error(
        "your LoRA adapters fill your share of adapter memory (tiers.{tier}.max_cpu_loras_per_tenant: \
         {limit}) and all are in use by your requests; retry when one of those requests ends"
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
    /// The tenant charged for it (its share, `Charge`): the one whose request read it into
    /// memory, or one whose requests use it when the charge moved
    /// ([`LoraManager::make_share_room`]); `None`: an operator's registration or replacement.
    owner: Option<Charge>,
    /// The tenants whose requests took it, each with the tier its latest request named and
    /// the mark each of those requests holds a clone of (held while the count is above one);
    /// entries no request holds are dropped when another tenant is marked.
    users: Mutex<Vec<(Charge, Arc<()>)>>,
}

impl Resident {
    /// `adapter` in memory, charged to `owner`, last used at `now`, no request's yet.
    fn new(id: u32, adapter: Arc<LoraAdapter>, now: u64, owner: Option<Charge>) -> Self {
        Resident {
            id,
            adapter,
            last_used: AtomicU64::new(now),
            owner,
            users: Mutex::new(Vec::new()),
        }
    }

    /// A request of `charge`'s tenant takes the adapter: its mark (none without a charge).
    fn mark(&self, charge: Option<&Charge>) -> Option<AdapterUser> {
        let charge = charge?;
        let mut users = self.users.lock();
        users.retain(|(c, m)| Arc::strong_count(m) > 1 || c.tenant == charge.tenant);
        let mark = match users.iter_mut().find(|(c, _)| c.tenant == charge.tenant) {
            Some((c, m)) => {
                c.tier = charge.tier.clone();
                m.clone()
            }
            None => {
                let m = Arc::new(());
                users.push((charge.clone(), m.clone()));
                m
            }
        };
        Some(AdapterUser { _mark: mark })
    }

    /// The tenants whose requests hold the adapter now, by name (with their latest tier).
    fn holders(&self) -> Vec<Charge> {
        let mut holders: Vec<Charge> = self
            .users
            .lock()
            .iter()
            .filter(|(_, m)| Arc::strong_count(m) > 1)
            .map(|(c, _)| c.clone())
            .collect();
        holders.sort_by(|a, b| a.tenant.cmp(&b.tenant));
        holders
    }
}

/// One request's use of an adapter in memory, held beside the weights until the request
/// ends: it tells the LoRA manager which tenants' requests use an adapter, so that a tenant
/// charged for an adapter only other tenants use is not refused for it
/// ([`LoraManager::make_share_room`]).
#[derive(Clone, Debug)]
pub struct AdapterUser {
    _mark: Arc<()>,
}

/// An adapter resolved for a request: its id (the prefix-cache key), its weights and the
/// request's mark as one of its users (none for an uncharged resolution).
#[derive(Clone, Debug)]
pub struct Resolved {
    /// The registration's id.
    pub id: u32,
    /// The weights.
    pub adapter: Arc<LoraAdapter>,
    /// The request's use, held with the weights.
    pub user: Option<AdapterUser>,
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
    /// At each read's start, the adapters in memory and whether one of them could have been
    /// dropped (no request holds it and it is not pinned).
    #[cfg(test)]
    read_starts: Mutex<Vec<(usize, bool)>>,
}

/// The registered adapters and the weights of those in memory, as other threads see them:
/// model lists, name checks and, for adapters in memory, request resolution, all without a
/// trip through the manager's thread.
#[derive(Clone, Default)]
pub struct LoraRegistry(Arc<SharedRegistry>);

/// What the registry knows of a name.
enum Lookup {
    /// In memory: the id, the weights and the request's mark.
    Resident(Resolved),
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

    /// The id and weights of `name` if they are in memory, marking it used (by `charge`'s
    /// tenant: weights and mark are taken under one read lock, so the manager, under the write
    /// lock, sees both or neither).
    fn lookup(&self, name: &str, charge: Option<&Charge>) -> Lookup {
        let state = self.0.state.read();
        if let Some(r) = state.resident.get(name) {
            r.last_used.store(self.tick(), Ordering::Relaxed);
            Lookup::Resident(Resolved {
                id: r.id,
                adapter: r.adapter.clone(),
                user: r.mark(charge),
            })
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

    /// Records what memory holds as a read starts ([`SharedRegistry::read_starts`]).
    #[cfg(test)]
    fn note_read_start(&self) {
        let state = self.0.state.read();
        let droppable = state.resident.iter().any(|(name, r)| {
            Arc::strong_count(&r.adapter) == 1
                && !state.adapters.iter().any(|a| a.pinned && &a.name == name)
        });
        self.0
            .read_starts
            .lock()
            .push((state.resident.len(), droppable));
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
    ) -> Result<Resolved, LoraError> {
        match self.registry.lookup(name, charge) {
            Lookup::Resident(resolved) => {
                if self.registry.take_over_limit() {
                    self.addr.do_send(Evict);
                }
                Ok(resolved)
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

/// A registration, with the adapter's weights (and the caller's mark as a user) when the
/// registering caller holds them.
type Registered = (AdapterInfo, Option<Resolved>);

/// Who keeps a new registration's weights from the eviction that follows it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Keep {
    /// No one (the configuration's and an admin's registrations).
    Nobody,
    /// The caller, which gets them (a request resolving a name it found).
    Caller,
}

/// What an adapter is read for ([`LoraManager::make_read_room`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ReadFor {
    /// A new registration, which unregisters an adapter found in a directory once read when
    /// the registry is full.
    Registration,
    /// A registered name's weights: a reload (for a request or a pin) or a replacement.
    Weights,
}

/// What [`LoraManager::make_share_room`] does in a tenant's full share.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ShareRoom {
    /// Only decides: refuses when the share's adapters that no step can move or drop (in use
    /// by the tenant's own requests, or by no tenant's) fill it ([`share_fits`]); moves and
    /// drops nothing.
    Check,
    /// Makes room: moves charges to other tenants using the adapters and drops the tenant's
    /// least recently used unused adapters ([`share_step`]) until the share has room.
    Make,
}

/// The next step [`LoraManager::make_share_room`] takes in a tenant's share.
#[derive(Clone, Debug, PartialEq, Eq)]
enum ShareStep {
    /// The share has room for one more adapter.
    Room,
    /// The adapter's charge moves to the tenant named (one whose requests use it).
    Move(String, Charge),
    /// The adapter, no request's, is dropped.
    Drop(String),
    /// Every adapter of the share is in use by the tenant's own requests (or by no tenant's):
    /// the load is refused.
    Full,
}

/// What makes room next in the share (`limit` adapters) of `tenant` in `state`, `shares`
/// being the tiers' shares; pinned adapters count in no share. First, an adapter charged to
/// the tenant that no request of its uses but other tenants' requests do has its charge
/// moved to the one of those with the most room in its share (a tier without a share: all
/// the room; ties: the first by name), if it has room: that tenant's requests use the
/// memory, and its share bounds what it is charged; the least recently used such adapter
/// first. Else the tenant's least recently used adapter that no request holds is dropped.
/// Else such a charge moves to the user with the most room even though it has none: an
/// adapter other tenants keep busy never keeps its loader out (nor can any tenant lock
/// another out so); the user, now beyond its share, makes room in it at its own next load
/// and its unused adapters are the first dropped from full memory ([`LoraManager::evict`]).
fn share_step(
    state: &RegistryState,
    shares: &HashMap<String, usize>,
    tenant: &str,
    limit: usize,
) -> ShareStep {
    let pinned: Vec<&str> = state
        .adapters
        .iter()
        .filter(|a| a.pinned)
        .map(|a| a.name.as_str())
        .collect();
    let charged = |t: &str| {
        state
            .resident
            .iter()
            .filter(|(name, r)| {
                r.owner.as_ref().is_some_and(|o| &*o.tenant == t)
                    && !pinned.contains(&name.as_str())
            })
            .count()
    };
    let theirs: Vec<(&String, &Resident)> = state
        .resident
        .iter()
        .filter(|(name, r)| {
            r.owner.as_ref().is_some_and(|o| &*o.tenant == tenant)
                && !pinned.contains(&name.as_str())
        })
        .collect();
    if theirs.len() < limit {
        return ShareStep::Room;
    }
    let used = |r: &Resident| r.last_used.load(Ordering::Relaxed);
    // Per adapter only other tenants use: its user with the most room, and that room.
    let movable = theirs.iter().filter_map(|(name, r)| {
        if Arc::strong_count(&r.adapter) == 1 {
            return None;
        }
        let holders = r.holders();
        if holders.iter().any(|h| &*h.tenant == tenant) {
            return None;
        }
        let room = |h: &Charge| match shares.get(&*h.tier) {
            Some(&share) => share as i64 - charged(&h.tenant) as i64,
            None => i64::MAX,
        };
        let (room, to) = holders
            .into_iter()
            .map(|h| (room(&h), h))
            .min_by_key(|(room, _)| std::cmp::Reverse(*room))?;
        Some((room, used(r), (*name).clone(), to))
    });
    let movable: Vec<(i64, u64, String, Charge)> = movable.collect();
    if let Some((_, _, name, to)) = movable
        .iter()
        .filter(|(room, ..)| *room > 0)
        .min_by_key(|(_, used, ..)| *used)
    {
        return ShareStep::Move(name.clone(), to.clone());
    }
    if let Some((name, _)) = theirs
        .iter()
        .filter(|(_, r)| Arc::strong_count(&r.adapter) == 1)
        .min_by_key(|(_, r)| used(r))
    {
        return ShareStep::Drop((*name).clone());
    }
    movable
        .into_iter()
        .min_by_key(|(room, used, ..)| (std::cmp::Reverse(*room), *used))
        .map_or(ShareStep::Full, |(_, _, name, to)| {
            ShareStep::Move(name, to)
        })
}

/// Whether [`share_step`]'s steps end with room in `tenant`'s share (`limit` adapters): each
/// moves or drops one of its adapters, and every one that no request holds, or that only other
/// tenants' requests hold, can go; so there is room unless the ones that must stay (held by
/// the tenant's own requests, or by no tenant's) fill the share.
fn share_fits(state: &RegistryState, tenant: &str, limit: usize) -> bool {
    let pinned = |name: &str| state.adapters.iter().any(|a| a.pinned && a.name == name);
    let stay = state
        .resident
        .iter()
        .filter(|(name, r)| {
            r.owner.as_ref().is_some_and(|o| &*o.tenant == tenant)
                && !pinned(name)
                && Arc::strong_count(&r.adapter) != 1
        })
        .filter(|(_, r)| {
            let holders = r.holders();
            holders.is_empty() || holders.iter().any(|h| &*h.tenant == tenant)
        })
        .count();
    stay < limit
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
    share_refusals: switchyard_policies::rate_limit::LogThrottle,
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
            share_refusals: switchyard_policies::rate_limit::LogThrottle::new(
                super::admission::REFUSAL_LOG_INTERVAL,
            ),
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
        #[cfg(test)]
        self.registry.note_read_start();
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

    /// Checks the adapter at `path` as far as can be done without reading its weights
    /// ([`LoraAdapter::check`]: its `adapter_config.json` and the header of its
    /// `adapter_model.safetensors`), refusing for the reason a load would give
    /// ([`LoraError::Load`]); nothing is read into memory, and `reads` does not count it.
    fn check(&self, path: &Path) -> Result<(), LoraError> {
        LoraAdapter::check(path, &self.config.model, &self.config.limits).map_err(|e| {
            tracing::debug!(path = %path.display(), error = %e,
                "LoRA adapter refused by its header before room was made in memory for it");
            LoraError::Load(e)
        })
    }

    /// Puts `adapter` in memory under `name` and `id`, charged to `owner`; `user`'s mark as
    /// its first user.
    fn make_resident(
        &self,
        name: &str,
        id: u32,
        adapter: Arc<LoraAdapter>,
        owner: Option<Charge>,
        user: Option<&Charge>,
    ) -> Option<AdapterUser> {
        let resident = Resident::new(id, adapter, self.registry.tick(), owner);
        let mark = resident.mark(user);
        let old = self
            .registry
            .0
            .state
            .write()
            .resident
            .insert(name.to_owned(), resident);
        // Weights are freed outside the lock (none are replaced: the manager checks first).
        drop(old);
        mark
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
        // A full share of adapters in use refuses before any read; room in it is made once
        // the adapter has loaded (before the read when memory is full, once the files pass
        // the check), so a load that fails drops none of the tenant's adapters.
        self.make_share_room(charge, ShareRoom::Check)?;
        let unregisters = self.make_read_room(charge, ReadFor::Registration, None, path)?;
        let adapter = self.load(path)?;
        self.make_share_room(charge, ShareRoom::Make)?;
        // Room made once the adapter loaded, so a refused one unregisters nothing.
        if let Err(LoraError::Busy(..)) = self.make_room(name, unregisters) {
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
        let resident = Resident::new(info.id, adapter, self.registry.tick(), charge.cloned());
        let held = (hold == Keep::Caller).then(|| Resolved {
            id: info.id,
            adapter: resident.adapter.clone(),
            user: resident.mark(charge),
        });
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
        if pinned && matches!(self.registry.lookup(name, None), Lookup::Evicted) {
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
    /// none can go. `first`, if it is still one that can go, goes first: the victim chosen
    /// before the read when memory was full ([`Self::make_read_room`]), which dropped it from
    /// memory, so that it is no longer told from those never in memory.
    fn make_room(&mut self, name: &str, mut first: Option<String>) -> Result<(), LoraError> {
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
                let first = first
                    .take()
                    .filter(|f| Self::room_victims_in(&state).any(|(_, v)| v == f));
                let Some(victim) = first.or_else(|| Self::room_victim_in(&state)) else {
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
        Self::room_victims_in(state)
            .min_by_key(|(used, _)| *used)
            .map(|(_, name)| name.clone())
    }

    /// The discovered adapters [`Self::make_room`] may unregister (not pinned, and no request
    /// holds them), each with when it was last used (0: not in memory).
    fn room_victims_in(state: &RegistryState) -> impl Iterator<Item = (u64, &String)> {
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
        // The old weights count in memory while the new ones are read, and stay served if
        // the new ones fail to read.
        self.make_read_room(None, ReadFor::Weights, Some(name), path)?;
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
        let resident = Resident::new(id, adapter, self.registry.tick(), None);
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
        self.resolve_for(name, None).map(|r| (r.id, r.adapter))
    }

    /// The id and weights of `name` for a request, loading them, charged to `charge`'s
    /// tenant, if they are not in memory.
    pub fn resolve_for(
        &mut self,
        name: &str,
        charge: Option<&Charge>,
    ) -> Result<Resolved, LoraError> {
        let resolved = match self.registry.lookup(name, charge) {
            Lookup::Resident(resolved) => Ok(resolved),
            Lookup::Evicted => self.reload(name, charge),
            // Registered just now, with the weights held: the eviction that followed the
            // registration could not drop them.
            Lookup::Unknown => match self.discover(name, Keep::Caller, charge) {
                Ok(Some((_, Some(resolved)))) => Ok(resolved),
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
    fn reload(&mut self, name: &str, charge: Option<&Charge>) -> Result<Resolved, LoraError> {
        let info = self
            .registry
            .info(name)
            .ok_or_else(|| LoraError::Unknown(name.to_owned()))?;
        // A pinned adapter is no tenant's (reloaded when pinned).
        let request = charge;
        let charge = charge.filter(|_| !info.pinned);
        // As in `register_held`: refused before the read, room made after it (before it
        // when memory is full, once the files' configuration and header pass the check: a
        // failure then is the load's, handled alike).
        self.make_share_room(charge, ShareRoom::Check)?;
        let read = self
            .make_read_room(charge, ReadFor::Weights, None, &info.path)
            .and_then(|_| self.load(&info.path));
        let adapter = match read {
            Ok(adapter) => adapter,
            Err(LoraError::Load(e)) if info.discovered => {
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
            Err(LoraError::Load(e)) => {
                tracing::warn!(
                    name,
                    path = %info.path.display(),
                    error = %e,
                    "LoRA adapter could not be loaded again; its requests fail until its files \
                     are restored or it is unloaded"
                );
                return Err(LoraError::Reload(name.to_owned()));
            }
            // A refusal of the tenant's share, as before the read.
            Err(e) => return Err(e),
        };
        self.make_share_room(charge, ShareRoom::Make)?;
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
        // The request is the adapter's first user (its own charge: a pinned adapter's user
        // is marked all the same).
        let user = self.make_resident(name, id, adapter.clone(), charge.cloned(), request);
        Ok(Resolved { id, adapter, user })
    }

    /// Makes room for one more adapter in the share of memory of `charge`'s tenant (its
    /// tier's `max_cpu_loras_per_tenant`; nothing without a charge or a share), one step at a
    /// time ([`share_step`]) while the adapters charged to it (pinned ones aside) fill the
    /// share: an adapter of its that only other tenants' requests use has its charge moved
    /// to one of those tenants (one whose share has room, before any of its own adapters is
    /// dropped); else its least recently used adapter that no request holds is dropped; else
    /// such an adapter's charge moves to a user beyond that user's share (it is that user's
    /// memory: its own loads then make room); when every one is in use by the tenant's own
    /// requests (or by no tenant's), the load is refused ([`LoraError::TenantShare`]). Never
    /// another tenant's adapter dropped. With [`ShareRoom::Check`] nothing changes: only the
    /// refusal is decided (before a read), for all the steps to come ([`share_fits`]).
    fn make_share_room(
        &mut self,
        charge: Option<&Charge>,
        room: ShareRoom,
    ) -> Result<(), LoraError> {
        let Some(charge) = charge else {
            return Ok(());
        };
        let shares = self.registry.0.shares.read().clone();
        let Some(&limit) = shares.get(&*charge.tier) else {
            return Ok(());
        };
        let labels = crate::metric_names::tier_labels(&charge.tier);
        loop {
            let dropped = {
                // Chosen and changed under one write lock: readers clone weights and marks only
                // under the read lock, so none can take up the victim, or start using an
                // adapter whose charge moves, in between.
                let mut state = self.registry.0.state.write();
                let step = match (share_step(&state, &shares, &charge.tenant, limit), room) {
                    (ShareStep::Room, _) => return Ok(()),
                    // Decided for all the steps to come, not the first only: moving one charge
                    // may leave the share full of adapters that must stay.
                    (_, ShareRoom::Check) if share_fits(&state, &charge.tenant, limit) => {
                        return Ok(())
                    }
                    (_, ShareRoom::Check) => ShareStep::Full,
                    (step, ShareRoom::Make) => step,
                };
                match step {
                    ShareStep::Room => return Ok(()),
                    ShareStep::Full => {
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
                                 fill its tier's tiers.<name>.max_cpu_loras_per_tenant and all \
                                 are in use by its own requests (refused counts the refusals \
                                 since the previous such line)"
                            );
                        }
                        return Err(LoraError::TenantShare {
                            tier: charge.tier.to_string(),
                            limit,
                        });
                    }
                    ShareStep::Drop(victim) => {
                        tracing::debug!(name = %victim, tenant = %charge.tenant,
                            "LoRA adapter evicted from memory to make room in its tenant's share");
                        metrics::counter!(
                            crate::metric_names::LORA_SHARE_EVICTIONS,
                            labels.clone()
                        )
                        .increment(1);
                        state.resident.remove(&victim)
                    }
                    ShareStep::Move(name, to) => {
                        tracing::debug!(name = %name, from = %charge.tenant, to = %to.tenant,
                            "LoRA adapter's charge moved to a tenant whose requests use it, to \
                             make room in the share of the tenant charged for it");
                        metrics::counter!(
                            crate::metric_names::LORA_SHARE_TRANSFERS,
                            labels.clone()
                        )
                        .increment(1);
                        if let Some(r) = state.resident.get_mut(&name) {
                            r.owner = Some(to);
                        }
                        None
                    }
                }
            };
            // The weights are freed outside the lock.
            drop(dropped);
        }
    }

    /// Drops least recently used adapters that no request holds while more than `max_loaded`
    /// are in memory, those of tenants charged beyond their share first (a charge moved to a
    /// tenant whose requests used the adapter, or a lowered share); flags the registry when
    /// adapters in use keep it over the limit.
    fn evict(&mut self) {
        self.evict_to(self.config.max_loaded, None);
    }

    /// Makes room in memory for the adapter at `path`, about to be read, so that the adapters
    /// in memory and the one being read are at most `max_loaded` while it is read. Once memory
    /// is full, the adapter's files are checked first, from its `adapter_config.json` and the
    /// header of its `adapter_model.safetensors` alone ([`Self::check`]: kilobytes read, no
    /// weights): files a load would refuse for their configuration, their header or their
    /// tensors' names, types and shapes are refused here, for the load's reason, and nothing
    /// is dropped. Then what the load would otherwise drop once read goes, before the read: the tenant's
    /// room in its share ([`Self::make_share_room`]: charges moved, or its own least recently
    /// used adapter that no request holds), the adapter found in a directory that a
    /// registration unregisters from a full registry ([`Self::room_victim`]); then the least
    /// recently used adapters that no request holds, as [`Self::evict`] drops them, but for
    /// `keep` (a replacement's old weights: requests for the name are served them while the
    /// new ones are read, and a replacement that fails to read leaves them served, whatever
    /// its directory now holds). A read that passed the check and still fails (values that
    /// are not finite, or files changed in between) leaves its slot free, and an adapter
    /// dropped for it is read again when a request names it. Adapters in use and
    /// pinned ones are never dropped: with memory full of them the read goes ahead (its
    /// request is served, as it always was) and memory holds more while they are in use.
    /// The manager's one thread is the only one that reads adapters and puts them in memory,
    /// so no other read takes the slot meanwhile: loads asked for at once are read one after
    /// the other, each making its own room.
    fn make_read_room(
        &mut self,
        charge: Option<&Charge>,
        read: ReadFor,
        keep: Option<&str>,
        path: &Path,
    ) -> Result<Option<String>, LoraError> {
        let (registry, max) = (self.registry.clone(), self.config.max_loaded);
        let full = || registry.0.state.read().resident.len() >= max;
        if !full() {
            return Ok(None);
        }
        // Nothing is dropped for files that a load would refuse for their configuration or
        // their tensors' names, types and shapes.
        self.check(path)?;
        self.make_share_room(charge, ShareRoom::Make)?;
        let mut unregisters = None;
        if full() && read == ReadFor::Registration {
            let max_adapters = self.config.max_adapters;
            let dropped = {
                // Chosen and dropped under one write lock, as every eviction.
                let mut state = self.registry.0.state.write();
                unregisters = (state.adapters.len() >= max_adapters)
                    .then(|| Self::room_victim_in(&state))
                    .flatten();
                unregisters
                    .as_ref()
                    .and_then(|victim| state.resident.remove(victim))
            };
            // The weights are freed outside the lock.
            drop(dropped);
        }
        self.evict_to(self.config.max_loaded.saturating_sub(1), keep);
        Ok(unregisters)
    }

    /// [`Self::evict`] down to `limit` adapters in memory (`max_loaded` or fewer), `keep`
    /// never dropped; the registry is flagged against `max_loaded`.
    fn evict_to(&mut self, limit: usize, keep: Option<&str>) {
        let max = self.config.max_loaded;
        let shared = &self.registry.0;
        let in_memory = shared.state.read().resident.len();
        if in_memory <= limit {
            shared.over_limit.store(in_memory > max, Ordering::Release);
            return;
        }
        let shares = shared.shares.read().clone();
        let mut dropped = Vec::new();
        let mut state = shared.state.write();
        let pinned: Vec<String> = state
            .adapters
            .iter()
            .filter(|a| a.pinned)
            .map(|a| a.name.clone())
            .collect();
        while state.resident.len() > limit {
            // Only the registry holds an unused adapter's weights; readers clone them only
            // under the read lock, so none can start using a victim while this lock is held.
            let mut charged: HashMap<&str, usize> = HashMap::new();
            for (name, r) in &state.resident {
                if let Some(o) = r.owner.as_ref().filter(|_| !pinned.contains(name)) {
                    *charged.entry(&*o.tenant).or_default() += 1;
                }
            }
            let beyond = |r: &Resident| {
                r.owner.as_ref().is_some_and(|o| {
                    shares
                        .get(&*o.tier)
                        .is_some_and(|&s| charged.get(&*o.tenant).copied().unwrap_or(0) > s)
                })
            };
            let victim = state
                .resident
                .iter()
                .filter(|(name, r)| {
                    Arc::strong_count(&r.adapter) == 1
                        && !pinned.contains(name)
                        && keep != Some(name.as_str())
                })
                .min_by_key(|(_, r)| (!beyond(r), r.last_used.load(Ordering::Relaxed)))
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
#[rtype(result = "Result<Resolved, LoraError>")]
struct Resolve(String, Option<Charge>);

impl Handler<Resolve> for LoraManager {
    type Result = Result<Resolved, LoraError>;
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
#[path = "lora_tests.rs"]
pub(crate) mod tests;
