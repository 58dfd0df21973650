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
//! Memory. At most `max_adapters` names are registered and at most `max_loaded` adapters are
//! kept loaded while no request uses them; beyond that, the least recently used unused adapter
//! is dropped and loaded again on its next request. Adapters in use stay loaded, so memory is
//! bounded by `max_adapters` adapters of at most `max_lora_rank`. How many different adapters
//! run in one step is the scheduler's limit (`max_loras`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use actix::{Actor, Handler, Message, SyncContext};
use parking_lot::RwLock;
use switchyard_gpu::model::LlamaConfig;
use switchyard_gpu::{GpuError, LoraAdapter, LoraLimits};

/// Longest adapter name accepted.
pub const MAX_ADAPTER_NAME: usize = 128;

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
    /// Most adapters kept loaded while unused.
    pub max_loaded: usize,
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
}

/// What can go wrong with adapters.
#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    /// No adapter is registered under the name.
    #[error("no LoRA adapter named '{0}'")]
    Unknown(String),
    /// The name is taken.
    #[error("a LoRA adapter named '{0}' is already loaded; unload it first")]
    Exists(String),
    /// The name is empty, too long, has control characters or is the base model's.
    #[error("bad LoRA adapter name: {0}")]
    BadName(String),
    /// The registry is full.
    #[error("{0} LoRA adapters are loaded, the configured maximum (lora.max_adapters); unload one first")]
    Full(usize),
    /// The adapter's files are missing, malformed or do not fit the model.
    #[error(transparent)]
    Load(#[from] GpuError),
    /// LoRA is not enabled in this server.
    #[error("LoRA adapters are not enabled on this server (lora.enabled)")]
    Disabled,
}

struct Entry {
    info: AdapterInfo,
    loaded: Option<Arc<LoraAdapter>>,
    last_used: u64,
    /// What the weights under `info.id` are ([`LoraAdapter::fingerprint`]).
    fingerprint: [u8; 32],
}

/// The registered adapters as other threads see them (for model lists and name checks).
#[derive(Clone, Default)]
pub struct LoraRegistry(Arc<RwLock<Vec<AdapterInfo>>>);

impl LoraRegistry {
    /// Every registered adapter, in registration order.
    pub fn list(&self) -> Vec<AdapterInfo> {
        self.0.read().clone()
    }
}

/// The LoRA manager actor.
pub struct LoraManager {
    config: LoraManagerConfig,
    entries: Vec<Entry>,
    next_id: u32,
    clock: u64,
    view: LoraRegistry,
}

impl LoraManager {
    /// A manager with no adapters; `view` is updated on every change.
    pub fn new(config: LoraManagerConfig, view: LoraRegistry) -> Self {
        LoraManager {
            config,
            entries: Vec::new(),
            next_id: 1,
            clock: 0,
            view,
        }
    }

    fn publish(&self) {
        *self.view.0.write() = self.entries.iter().map(|e| e.info.clone()).collect();
        metrics::gauge!(crate::metric_names::LORA_ADAPTERS).set(self.entries.len() as f64);
    }

    fn check_name(&self, name: &str) -> Result<(), LoraError> {
        let bad = |m: &str| Err(LoraError::BadName(m.to_owned()));
        if name.is_empty() || name.chars().count() > MAX_ADAPTER_NAME {
            return bad(&format!("a name has 1 to {MAX_ADAPTER_NAME} characters"));
        }
        if name.chars().any(|c| c.is_control()) {
            return bad("control characters are not allowed");
        }
        if name == self.config.base_name {
            return bad("that is the base model's name");
        }
        Ok(())
    }

    fn load(&self, path: &Path) -> Result<Arc<LoraAdapter>, LoraError> {
        let t0 = std::time::Instant::now();
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

    /// Registers `name` at `path`, loading the adapter to check it.
    pub fn register(&mut self, name: &str, path: &Path) -> Result<AdapterInfo, LoraError> {
        self.check_name(name)?;
        if self.entries.iter().any(|e| e.info.name == name) {
            return Err(LoraError::Exists(name.to_owned()));
        }
        if self.entries.len() >= self.config.max_adapters {
            return Err(LoraError::Full(self.config.max_adapters));
        }
        let adapter = self.load(path)?;
        let info = AdapterInfo {
            name: name.to_owned(),
            id: self.fresh_id(),
            path: path.to_path_buf(),
            rank: adapter.rank(),
        };
        self.clock += 1;
        self.entries.push(Entry {
            info: info.clone(),
            fingerprint: adapter.fingerprint(),
            loaded: Some(adapter),
            last_used: self.clock,
        });
        self.evict();
        self.publish();
        tracing::info!(name, id = info.id, "LoRA adapter registered");
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
        let i = self
            .entries
            .iter()
            .position(|e| e.info.name == name)
            .ok_or_else(|| LoraError::Unknown(name.to_owned()))?;
        self.entries.remove(i);
        self.publish();
        tracing::info!(name, "LoRA adapter unregistered");
        Ok(())
    }

    /// The id and weights of `name`, loading them if they were evicted.
    pub fn resolve(&mut self, name: &str) -> Result<(u32, Arc<LoraAdapter>), LoraError> {
        let i = self
            .entries
            .iter()
            .position(|e| e.info.name == name)
            .ok_or_else(|| LoraError::Unknown(name.to_owned()))?;
        self.clock += 1;
        let adapter = match &self.entries[i].loaded {
            Some(a) => a.clone(),
            None => {
                let a = self.load(&self.entries[i].info.path)?;
                if a.fingerprint() != self.entries[i].fingerprint {
                    // The files changed since they were loaded: other weights, so another
                    // prefix-cache key (blocks cached under the old id are never reused).
                    let id = self.fresh_id();
                    let e = &mut self.entries[i];
                    tracing::warn!(
                        name = %e.info.name,
                        old_id = e.info.id,
                        new_id = id,
                        "LoRA adapter files changed since they were loaded; serving the new weights under a new id"
                    );
                    e.info.id = id;
                    e.info.rank = a.rank();
                    e.fingerprint = a.fingerprint();
                    self.publish();
                }
                self.entries[i].loaded = Some(a.clone());
                a
            }
        };
        self.entries[i].last_used = self.clock;
        let id = self.entries[i].info.id;
        self.evict();
        Ok((id, adapter))
    }

    /// Drops least recently used adapters that no request holds while more than `max_loaded`
    /// are loaded.
    fn evict(&mut self) {
        loop {
            let loaded = self.entries.iter().filter(|e| e.loaded.is_some()).count();
            if loaded <= self.config.max_loaded {
                return;
            }
            let victim = self
                .entries
                .iter_mut()
                .filter(|e| e.loaded.as_ref().is_some_and(|a| Arc::strong_count(a) == 1))
                .min_by_key(|e| e.last_used);
            match victim {
                Some(e) => {
                    tracing::debug!(name = %e.info.name, "LoRA adapter evicted from memory");
                    e.loaded = None;
                }
                None => return,
            }
        }
    }

    /// Names of the adapters held in memory.
    #[cfg(test)]
    fn loaded(&self) -> Vec<&str> {
        self.entries
            .iter()
            .filter(|e| e.loaded.is_some())
            .map(|e| e.info.name.as_str())
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
}

impl Handler<Register> for LoraManager {
    type Result = Result<AdapterInfo, LoraError>;
    fn handle(&mut self, msg: Register, _: &mut Self::Context) -> Self::Result {
        self.register(&msg.name, &msg.path)
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

/// Resolves an adapter name for a request.
#[derive(Message)]
#[rtype(result = "Result<(u32, Arc<LoraAdapter>), LoraError>")]
pub struct Resolve(pub String);

impl Handler<Resolve> for LoraManager {
    type Result = Result<(u32, Arc<LoraAdapter>), LoraError>;
    fn handle(&mut self, msg: Resolve, _: &mut Self::Context) -> Self::Result {
        self.resolve(&msg.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../gpu/tests/fixtures/lora/smollm2-r4")
    }

    fn manager(max_adapters: usize, max_loaded: usize) -> LoraManager {
        LoraManager::new(
            LoraManagerConfig {
                model: LlamaConfig::smollm2_135m(),
                base_name: "base".into(),
                limits: LoraLimits::default(),
                max_adapters,
                max_loaded,
            },
            LoraRegistry::default(),
        )
    }

    #[test]
    fn registrations_get_fresh_ids_and_names_are_checked() {
        let mut m = manager(3, 3);
        let a = m.register("a", &fixture()).expect("a");
        assert!(matches!(
            m.register("a", &fixture()),
            Err(LoraError::Exists(_))
        ));
        for bad in ["", "base", "x\ny", &"n".repeat(MAX_ADAPTER_NAME + 1)] {
            assert!(
                matches!(m.register(bad, &fixture()), Err(LoraError::BadName(_))),
                "{bad:?}"
            );
        }
        assert!(matches!(
            m.register("missing", Path::new("/nonexistent/adapter")),
            Err(LoraError::Load(_))
        ));
        m.unregister("a").expect("unregister");
        assert!(matches!(m.resolve("a"), Err(LoraError::Unknown(_))));
        let again = m.register("a", &fixture()).expect("a again");
        assert_ne!(
            a.id, again.id,
            "a new registration is a new prefix-cache key"
        );
        assert_eq!(m.view.list(), vec![again]);
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
        assert_eq!(m.loaded(), vec!["b"]);
        // A request holds a's weights: a stays loaded past the limit while held.
        let (id_a, held) = m.resolve("a").expect("a");
        assert_eq!(m.loaded(), vec!["a"]);
        let (_, b) = m.resolve("b").expect("b");
        assert_eq!(m.loaded(), vec!["a", "b"]);
        drop(b);
        m.register("c", &fixture()).expect("c");
        assert_eq!(m.loaded(), vec!["a"], "b and c unused, a held");
        drop(held);
        let (id, _) = m.resolve("a").expect("a");
        assert_eq!(id, id_a);
        // Unregistering a held adapter leaves the holder's weights alone.
        let (_, c) = m.resolve("c").expect("c");
        m.unregister("c").expect("unregister");
        assert!(c.rank() == 4);
    }

    #[test]
    fn an_adapter_whose_files_changed_while_evicted_comes_back_under_a_new_id() {
        let dir = std::env::temp_dir().join(format!("sy-lora-changed-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["adapter_config.json", "adapter_model.safetensors"] {
            std::fs::copy(fixture().join(f), dir.join(f)).unwrap();
        }
        let mut m = manager(4, 1);
        let a = m.register("a", &dir).expect("a");
        m.register("b", &fixture()).expect("b");
        assert_eq!(m.loaded(), vec!["b"]);
        // Reloaded from unchanged files: the same weights, the same id.
        assert_eq!(m.resolve("a").expect("a").0, a.id);
        m.resolve("b").expect("b");
        assert_eq!(m.loaded(), vec!["b"]);
        // Reloaded after the files changed (another scale): a new id, listed as such.
        let config = std::fs::read_to_string(dir.join("adapter_config.json")).unwrap();
        let changed = config.replace("\"lora_alpha\": 8.0", "\"lora_alpha\": 16.0");
        assert_ne!(changed, config);
        std::fs::write(dir.join("adapter_config.json"), changed).unwrap();
        let (id, _) = m.resolve("a").expect("a");
        assert_ne!(
            id, a.id,
            "other weights never share the old id's cached blocks"
        );
        assert!(m.view.list().iter().any(|i| i.name == "a" && i.id == id));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
