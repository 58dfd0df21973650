//! Tests of the LoRA manager (`lora.rs`): registration, memory, found adapters, tenants'
//! shares, against the SmolLM2 fixture adapter.

use super::*;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../gpu/tests/fixtures/lora/smollm2-r4")
}

/// Registers the fixture adapter under `name`, not pinned.
fn register(name: &str) -> Register {
    Register {
        name: name.into(),
        path: fixture(),
        pinned: false,
    }
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
pub(crate) struct AdapterCopy(pub(crate) PathBuf);

impl AdapterCopy {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("sy-lora-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["adapter_config.json", "adapter_model.safetensors"] {
            std::fs::copy(fixture().join(f), dir.join(f)).unwrap();
        }
        AdapterCopy(dir)
    }

    /// A copy whose directory also holds copies of the test adapter named `names`.
    pub(crate) fn holding(tag: &str, names: &[&str]) -> Self {
        let root = Self::new(tag);
        for name in names {
            copy_into(&root.0, name);
        }
        root
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
    let (_copy, refused) = with_config("none", serde_json::json!({"target_modules": ["lm_head"]}));
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
    let reads = m.reads;
    let e = m.resolve("a").expect_err("the files are gone");
    assert!(matches!(&e, LoraError::Reload(n) if n == "a"), "{e:?}");
    let message = e.to_string();
    assert_eq!(message, "LoRA adapter 'a' could not be loaded");
    // Still registered. Refused before room was made for its read (memory keeps one
    // adapter, the one being read included): b stays, with no read again.
    assert!(m.registry.contains("a"));
    assert_eq!(m.loaded(), ["b"]);
    m.resolve("b").expect("b");
    assert_eq!((m.loaded(), m.reads), (vec!["b".to_string()], reads));
    // Weights that pass the check but not the load (a NaN): b made room for the read, the
    // slot stays free, and b is read again on its next request.
    std::fs::copy(
        fixture().join("adapter_model.safetensors"),
        dir.0.join("adapter_model.safetensors"),
    )
    .unwrap();
    poison(&dir.0);
    let e = m.resolve("a").expect_err("a NaN");
    assert!(matches!(&e, LoraError::Reload(n) if n == "a"), "{e:?}");
    assert!(m.loaded().is_empty());
    m.resolve("b").expect("b");
    assert_eq!((m.loaded(), m.reads), (vec!["b".to_string()], reads + 2));
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

/// A manager finding the adapters `names` (copies of the test adapter) in a fresh directory
/// `dir`, keeping at most `max_loaded` in memory, with tier `shares`' shares of adapters per
/// tenant. The copy lives as long as the returned guard.
fn sharing(
    dir: &str,
    names: &[&str],
    max_loaded: usize,
    shares: &[(&str, usize)],
) -> (AdapterCopy, LoraManager) {
    let root = AdapterCopy::holding(dir, names);
    let mut c = config(16, max_loaded);
    c.adapter_dirs = vec![root.0.clone()];
    c.tenant_shares = shares.iter().map(|&(t, n)| (t.into(), n)).collect();
    let m = LoraManager::new(c, LoraRegistry::default());
    (root, m)
}

/// A request of `tenant` in tier `tier`.
fn charge(tenant: &str, tier: &str) -> Charge {
    Charge {
        tenant: tenant.into(),
        tier: tier.into(),
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
    let root = AdapterCopy::holding("room", &["d1", "d2", "d3"]);
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
    let root = AdapterCopy::holding("found-two-checks", &["d1", "d2"]);
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
    let (_root, mut m) = sharing("share", &["a1", "a2", "a3", "b1"], 8, &[("gold", 2)]);
    let gold = |tenant: &str| charge(tenant, "gold");
    let (acme, bob) = (gold("acme"), gold("bob"));
    let serve = |m: &mut LoraManager, name: &str, who: &Charge| m.resolve_for(name, Some(who));
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
    serve(&mut m, "a2", &charge("acme", "free")).expect("a2");
    m.resolve("a3").expect("a3");
    assert_eq!(m.loaded(), ["b1", "a2", "a3", "a1"]);
}

/// Regression: a load for a tenant whose share was full dropped the tenant's least recently
/// used adapter before reading the new one, so a load that failed (broken files) dropped it
/// for nothing. Room in the share is made once the adapter has loaded; a share full of
/// adapters in use is still refused before any read.
#[test]
fn a_failed_load_drops_none_of_the_tenant_s_adapters() {
    let root = AdapterCopy::holding("share-fail", &["a1", "a2", "bad"]);
    std::fs::write(
        root.0.join("bad/adapter_model.safetensors"),
        b"not safetensors",
    )
    .unwrap();
    let mut c = config(16, 8);
    c.adapter_dirs = vec![root.0.clone()];
    c.tenant_shares = vec![("gold".into(), 1)];
    let mut m = LoraManager::new(c, LoraRegistry::default());
    let acme = charge("acme", "gold");
    m.resolve_for("a1", Some(&acme)).expect("a1");
    let reads = m.reads;
    m.resolve_for("bad", Some(&acme)).expect_err("broken files");
    assert_eq!(m.reads, reads + 1, "the broken adapter was read");
    assert_eq!(m.loaded(), ["a1"], "a1 kept: the failed load made no room");
    // A load that succeeds makes its room: a1 goes, a2 comes.
    m.resolve_for("a2", Some(&acme)).expect("a2");
    assert_eq!(m.loaded(), ["a2"]);
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
    let root = AdapterCopy::holding("room-admin", &["d1", "d2"]);
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
    let root = AdapterCopy::holding("room-pinned", &["d1", "d2"]);
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
    let root = AdapterCopy::holding("gone", &["d1", "d2", "d3"]);
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
    let id = lora.resolve("found", None).await.expect("found").id;
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
    let a = lora.ask(register("a")).await.expect("a");
    let b = lora.ask(register("b")).await.expect("b");
    // The manager's thread is taken (as by an admin load of a large adapter).
    let (release, hold) = std::sync::mpsc::channel();
    lora.addr.do_send(Hold(hold));
    // b is in memory: resolved from the registry, without waiting for the manager.
    let resolve_b = std::pin::pin!(lora.resolve("b", None));
    let id = poll_once(resolve_b)
        .expect("resolved without the manager")
        .expect("b")
        .id;
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
    let id = resolve_a.await.expect("a").id;
    assert_eq!(id, a.id);
}

#[actix::test]
async fn adapters_released_over_the_limit_are_evicted_on_the_next_request() {
    let lora = LoraHandle::start(config(4, 1));
    lora.ask(register("a")).await.expect("a");
    let held_a = lora.resolve("a", None).await.expect("a");
    // b, unused, makes way at once for a, in use.
    lora.ask(register("b")).await.expect("b");
    let in_memory = || lora.registry.0.state.read().resident.len();
    assert_eq!(in_memory(), 1);
    // Reloaded for a request while a is in use: two in memory, over the limit of one.
    let held_b = lora.resolve("b", None).await.expect("b");
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

/// What memory held as each read started since the last call: the adapters in memory (the
/// one being read aside) and whether one of them could have been dropped.
fn read_starts(registry: &LoraRegistry) -> Vec<(usize, bool)> {
    std::mem::take(&mut *registry.0.read_starts.lock())
}

/// Whether memory held at most `max` adapters, the one being read included, as each read
/// started, unless none could have been dropped (all in use or pinned).
fn bounded_while_read(starts: &[(usize, bool)], max: usize) -> bool {
    starts
        .iter()
        .all(|&(in_memory, droppable)| in_memory < max || !droppable)
}

/// Regression: an adapter read into full memory (a registration, a reload, a found adapter,
/// a replacement) was read beside the `max_cpu_loras` adapters in memory, and the least
/// recently used one that no request held was dropped only once the read ended: memory held
/// one adapter more than its bound for as long as each read took. Room is made before the
/// read now; a read that fails leaves its slot free, and the adapter dropped for it is read
/// again when a request names it; memory full of adapters in use still serves the read.
#[test]
fn memory_holds_at_most_max_cpu_loras_adapters_while_one_is_read() {
    let root = AdapterCopy::holding("read-room", &["d1", "bad"]);
    // Its configuration and header pass the check before the read; its values fail the load.
    poison(&root.0.join("bad"));
    let mut m = finder(8, 2, &[&root.0]);
    m.register("a", &fixture()).expect("a");
    m.register("b", &fixture()).expect("b");
    assert_eq!(read_starts(&m.registry), [(0, false), (1, true)]);
    // Full of unused adapters: each read finds one slot free (a registration, a reload, a
    // found adapter, a replacement: the old weights count while the new ones are read).
    m.register("c", &fixture()).expect("c");
    m.resolve("a").expect("a, read again");
    found(&mut m, "d1").expect("d1");
    m.replace("d1", &fixture()).expect("d1 replaced");
    m.resolve("a").expect("a, read again");
    let starts = read_starts(&m.registry);
    assert!(bounded_while_read(&starts, 2), "{starts:?}");
    assert_eq!(starts.len(), 5);
    assert_eq!(m.loaded(), ["a", "d1"]);
    // A read that passes the check and fails gives its slot back: one adapter in memory, and
    // the one dropped for the read (d1, the least recently used) is read again for its next
    // request.
    let e = m.resolve("bad").expect_err("broken files");
    assert!(matches!(e, LoraError::Reload(_)), "{e:?}");
    assert_eq!(m.loaded(), ["a"]);
    let reads = m.reads;
    m.resolve("d1").expect("d1");
    assert_eq!(m.reads, reads + 1);
    assert_eq!(m.loaded(), ["a", "d1"]);
    // Memory full of adapters in use: the read goes ahead and the request is served, memory
    // over its bound while they are in use, as before.
    let held = (m.resolve("a").expect("a"), m.resolve("d1").expect("d1"));
    let (_, b) = m
        .resolve("b")
        .expect("b, read with memory full of adapters in use");
    assert_eq!(m.loaded(), ["a", "b", "d1"]);
    let starts = read_starts(&m.registry);
    assert!(bounded_while_read(&starts, 2), "{starts:?}");
    assert_eq!(starts.last(), Some(&(2, false)));
    drop((held, b));
}

/// A replacement read into full memory keeps the old weights whoever is the least recently
/// used: the room is made from other adapters, and one whose files do not load leaves the
/// old weights served with no read again, even where the name's directory now holds broken
/// files. Files the check before the read refuses make no room; files that pass it and fail
/// the load (a NaN) leave the room made.
#[test]
fn a_failed_replacement_into_full_memory_leaves_the_old_weights_served() {
    let root = AdapterCopy::holding("replace-full", &["x"]);
    let dir = root.0.join("x");
    let mut m = manager(8, 2);
    m.register("x", &dir).expect("x");
    m.register("y", &fixture()).expect("y");
    m.resolve("y").expect("y");
    // x is now the least recently used; its files are overwritten with broken ones.
    std::fs::write(dir.join("adapter_model.safetensors"), b"not safetensors").unwrap();
    let reads = m.reads;
    let e = m.replace("x", &dir).expect_err("broken files");
    assert!(matches!(e, LoraError::Load(_)), "{e:?}");
    assert_eq!(m.loaded(), ["x", "y"], "refused before room was made");
    assert_eq!(m.reads, reads, "nothing read");
    std::fs::copy(
        fixture().join("adapter_model.safetensors"),
        dir.join("adapter_model.safetensors"),
    )
    .unwrap();
    poison(&dir);
    m.resolve("y").expect("y");
    let e = m.replace("x", &dir).expect_err("a NaN");
    assert!(matches!(e, LoraError::Load(_)), "{e:?}");
    assert_eq!(m.loaded(), ["x"], "y made the room for the read");
    let reads = m.reads;
    m.resolve("x").expect("the old weights, still in memory");
    assert_eq!(m.reads, reads);
}

/// Two requests for adapters out of memory at once, with one slot free: their reads, one
/// after the other on the manager's thread, each find room (the second drops the least
/// recently used adapter no request holds before it starts), never both in the last slot.
#[actix::test]
async fn two_reads_at_once_never_share_the_last_free_slot() {
    let lora = LoraHandle::start(config(8, 3));
    for name in ["a", "b", "c", "d", "e"] {
        lora.ask(register(name)).await.expect(name);
    }
    lora.ask(Unregister("e".into())).await.expect("e");
    let in_memory = || {
        let mut names: Vec<String> = lora
            .registry
            .0
            .state
            .read()
            .resident
            .keys()
            .cloned()
            .collect();
        names.sort();
        names
    };
    assert_eq!(in_memory(), ["c", "d"], "one slot free");
    read_starts(&lora.registry);
    // The manager's thread is taken while both requests ask for an adapter out of memory.
    let (release, hold) = std::sync::mpsc::channel();
    lora.addr.do_send(Hold(hold));
    let mut a = std::pin::pin!(lora.resolve("a", None));
    let mut b = std::pin::pin!(lora.resolve("b", None));
    assert!(poll_once(a.as_mut()).is_none() && poll_once(b.as_mut()).is_none());
    release.send(()).unwrap();
    let (a, b) = (a.await.expect("a"), b.await.expect("b"));
    let starts = read_starts(&lora.registry);
    assert_eq!(starts.len(), 2);
    assert!(bounded_while_read(&starts, 3), "{starts:?}");
    assert_eq!(in_memory().len(), 3);
    drop((a, b));
}

/// The tenant charged for each adapter in memory, by name (`None`: no tenant's).
fn owners(m: &LoraManager) -> Vec<(String, Option<String>)> {
    let state = m.registry.0.state.read();
    let mut owners: Vec<_> = state
        .resident
        .iter()
        .map(|(name, r)| (name.clone(), r.owner.as_ref().map(|o| o.tenant.to_string())))
        .collect();
    owners.sort();
    owners
}

/// Regression: a tenant whose charged adapters were all in use only by other tenants'
/// requests was refused (429) for as long as they used them, its own requests holding
/// nothing: the charge followed who loaded an adapter, not who used it. An adapter only
/// other tenants use has its charge moved to one of them whose share has room, so its
/// loader loads on; one the loader's own requests use stays its own, and the tenant the
/// charge moved to is bounded by its share from then on.
#[test]
fn an_adapter_only_other_tenants_use_moves_its_charge_to_them() {
    let (_root, mut m) = sharing("share-move", &["x", "y", "z"], 8, &[("gold", 1)]);
    let gold = |tenant: &str| charge(tenant, "gold");
    let (acme, bob) = (gold("acme"), gold("bob"));
    // acme reads x; bob's request takes it from memory (uncharged) and keeps it busy.
    drop(m.resolve_for("x", Some(&acme)).expect("x"));
    let bob_x = m.resolve_for("x", Some(&bob)).expect("x for bob");
    // acme's own requests hold nothing: its next load is served, x now bob's.
    let reads = m.reads;
    let acme_y = m
        .resolve_for("y", Some(&acme))
        .expect("y: x is only bob's to use");
    assert_eq!(m.reads, reads + 1);
    assert_eq!(
        owners(&m),
        [
            ("x".into(), Some("bob".into())),
            ("y".into(), Some("acme".into()))
        ]
    );
    // bob is charged for x now: its share is full of an adapter its request uses.
    let e = m
        .resolve_for("z", Some(&bob))
        .expect_err("bob's share holds x, in use");
    assert!(
        matches!(e, LoraError::TenantShare { limit: 1, .. }),
        "{e:?}"
    );
    // An adapter the charged tenant's own requests use stays its own, whoever else uses it.
    let bob_y = m.resolve_for("y", Some(&bob)).expect("y for bob");
    let e = m
        .resolve_for("z", Some(&acme))
        .expect_err("acme uses y itself");
    assert!(
        matches!(e, LoraError::TenantShare { limit: 1, .. }),
        "{e:?}"
    );
    drop((acme_y, bob_y));
    // Released, x is bob's to recycle: bob's next load drops it, not acme's y.
    drop(bob_x);
    m.resolve_for("z", Some(&bob)).expect("z");
    assert_eq!(m.loaded(), ["y", "z"]);
    assert_eq!(
        owners(&m),
        [
            ("y".into(), Some("acme".into())),
            ("z".into(), Some("bob".into()))
        ]
    );
}

/// A tenant cannot keep another out of its share by keeping the other's adapters busy: with
/// its own share full of adapters in use, the charge moves to it all the same, beyond its
/// share; its own loads are then refused while its requests use them all, and once released,
/// its adapters beyond its share are the first dropped from full memory (here before an
/// older adapter within another tenant's share).
#[test]
fn a_tenant_keeping_another_s_adapter_busy_is_charged_for_it_beyond_its_share() {
    let (_root, mut m) = sharing(
        "share-beyond",
        &["c", "w", "x", "y", "z"],
        3,
        &[("gold", 1)],
    );
    let gold = |tenant: &str| charge(tenant, "gold");
    let (acme, bob, carol) = (gold("acme"), gold("bob"), gold("carol"));
    drop(m.resolve_for("c", Some(&carol)).expect("c"));
    let bob_w = m.resolve_for("w", Some(&bob)).expect("w");
    drop(m.resolve_for("x", Some(&acme)).expect("x"));
    let bob_x = m.resolve_for("x", Some(&bob)).expect("x for bob");
    // bob's share is full of w, which it uses; acme's x, busy with bob's request only, is
    // charged to bob all the same, and acme loads y.
    let acme_y = m
        .resolve_for("y", Some(&acme))
        .expect("y: x is only bob's to use");
    let bob_owns = |m: &LoraManager| {
        owners(m)
            .into_iter()
            .filter(|(_, o)| o.as_deref() == Some("bob"))
            .count()
    };
    assert_eq!(bob_owns(&m), 2);
    // Memory (3) holds the three adapters in use; carol's unused c made way.
    assert_eq!(m.loaded(), ["w", "x", "y"]);
    // bob's own loads are refused while its requests use both.
    let e = m
        .resolve_for("z", Some(&bob))
        .expect_err("bob uses w and x");
    assert!(
        matches!(e, LoraError::TenantShare { limit: 1, .. }),
        "{e:?}"
    );
    // All released, x used last: memory full again (carol's c read back), bob's x, beyond
    // its share, goes before acme's y, older but within acme's share.
    drop((acme_y, bob_x));
    drop(m.resolve_for("x", Some(&bob)).expect("x"));
    drop(m.resolve_for("c", Some(&carol)).expect("c"));
    assert_eq!(m.loaded(), ["c", "w", "y"]);
    assert_eq!(bob_owns(&m), 1);
    drop(bob_w);
}

/// Which of an adapter's users its charge moves to: one with room in its share before one
/// without (even one used more recently), a tenant of a tier without a share (unbounded) as
/// any with room; and a full share whose adapters only requests of no tenant use is refused.
#[test]
fn a_charge_moves_to_the_user_with_the_most_room() {
    let (_root, mut m) = sharing(
        "share-room",
        &["b1", "x", "y", "z"],
        8,
        &[("gold", 1), ("silver", 2)],
    );
    let gold = |tenant: &str| charge(tenant, "gold");
    let (acme, bob) = (gold("acme"), gold("bob"));
    let dan = charge("dan", "silver");
    // bob's share is full (b1, in use); dan's has room: x goes to dan, though bob is first
    // by name.
    let bob_b1 = m.resolve_for("b1", Some(&bob)).expect("b1");
    drop(m.resolve_for("x", Some(&acme)).expect("x"));
    let users = (
        m.resolve_for("x", Some(&bob)).expect("x for bob"),
        m.resolve_for("x", Some(&dan)).expect("x for dan"),
    );
    m.resolve_for("y", Some(&acme)).expect("y");
    assert!(owners(&m).contains(&("x".into(), Some("dan".into()))));
    drop((users, bob_b1));
    // y is in use by an uncharged resolution only (no tenant's request): acme is refused.
    let _held = m.resolve("y").expect("y, uncharged");
    let e = m
        .resolve_for("z", Some(&acme))
        .expect_err("no tenant to charge");
    assert!(
        matches!(e, LoraError::TenantShare { limit: 1, .. }),
        "{e:?}"
    );
}

/// Regression: the check before a read looked at the first step only, so a tenant charged
/// beyond its share (two adapters, share 1) whose one movable adapter would not make room, its
/// other one in use by its own request, had its adapter read from disk and was refused only
/// after the read (the charge moved all the same). It is refused before the read now, and
/// nothing moves.
#[test]
fn a_share_that_moving_charges_cannot_free_is_refused_before_the_read() {
    let (_root, mut m) = sharing("share-check", &["c", "w", "x", "y", "z"], 8, &[("gold", 1)]);
    let gold = |tenant: &str| charge(tenant, "gold");
    let (acme, bob, carol) = (gold("acme"), gold("bob"), gold("carol"));
    let bob_w = m.resolve_for("w", Some(&bob)).expect("w");
    let carol_c = m.resolve_for("c", Some(&carol)).expect("c");
    drop(m.resolve_for("x", Some(&acme)).expect("x"));
    let bob_x = m.resolve_for("x", Some(&bob)).expect("x for bob");
    let carol_x = m.resolve_for("x", Some(&carol)).expect("x for carol");
    // Both users' shares are full: x moves beyond bob's (first by name).
    m.resolve_for("y", Some(&acme)).expect("y");
    assert!(owners(&m).contains(&("x".into(), Some("bob".into()))));
    // Only carol uses x now; bob uses w. Moving x would leave w, in use, filling bob's share.
    drop(bob_x);
    let reads = m.reads;
    let e = m
        .resolve_for("z", Some(&bob))
        .expect_err("bob's w is in use");
    assert!(
        matches!(e, LoraError::TenantShare { limit: 1, .. }),
        "{e:?}"
    );
    assert_eq!(m.reads, reads, "refused before reading z");
    assert!(owners(&m).contains(&("x".into(), Some("bob".into()))));
    // With w released, the same load makes room (x to carol, beyond; w dropped).
    drop(bob_w);
    m.resolve_for("z", Some(&bob)).expect("z");
    assert_eq!(m.reads, reads + 1);
    drop((carol_c, carol_x));
}

/// The adapters in memory, least recently used first.
fn lru(m: &LoraManager) -> Vec<String> {
    let state = m.registry.0.state.read();
    let mut by_use: Vec<(u64, String)> = state
        .resident
        .iter()
        .map(|(name, r)| (r.last_used.load(Ordering::Relaxed), name.clone()))
        .collect();
    by_use.sort();
    by_use.into_iter().map(|(_, name)| name).collect()
}

/// The header of `dir`'s `adapter_model.safetensors` (its JSON object) and where its data
/// starts.
fn header(dir: &Path) -> (serde_json::Map<String, serde_json::Value>, usize) {
    let bytes = std::fs::read(dir.join("adapter_model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (serde_json::from_slice(&bytes[8..8 + n]).unwrap(), 8 + n)
}

/// Rewrites the header of `dir`'s `adapter_model.safetensors` with `edit`, its data kept.
fn edit_header(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let path = dir.join("adapter_model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let (mut h, start) = header(dir);
    edit(&mut h);
    let mut text = serde_json::to_vec(&h).unwrap();
    while text.len() % 8 != 0 {
        text.push(b' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    out.extend(&bytes[start..]);
    std::fs::write(path, out).unwrap();
}

/// Renames the tensor `from` of `dir`'s adapter to `to`.
fn rename_tensor(dir: &Path, from: &str, to: &str) {
    edit_header(dir, |h| {
        let t = h.remove(from).unwrap();
        h.insert(to.into(), t);
    });
}

/// Sets `field` of the tensor `name` of `dir`'s adapter (its type or its shape).
fn set_tensor(dir: &Path, name: &str, field: &str, value: serde_json::Value) {
    edit_header(dir, |h| h[name][field] = value);
}

/// Sets `adapter_config.json` fields of `dir`'s adapter.
fn set_config(dir: &Path, fields: serde_json::Value) {
    let file = dir.join("adapter_config.json");
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    for (k, v) in fields.as_object().unwrap() {
        config[k] = v.clone();
    }
    std::fs::write(&file, config.to_string()).unwrap();
}

/// Layer 0's `q_proj` halves in the fixture adapter.
const Q0_A: &str = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
const Q0_B: &str = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight";

/// A way to break an adapter's files (its name, and what breaks the adapter in a directory).
type Breakage = (&'static str, fn(&Path));

/// Ways to break a copy of the fixture adapter (in the directory given) that a load refuses
/// for its configuration, the header of its weights' file or its tensors' names, types and
/// shapes: what the check before a read into full memory catches.
fn caught_before_the_read() -> Vec<Breakage> {
    vec![
        ("config-missing", |d| {
            std::fs::remove_file(d.join("adapter_config.json")).unwrap()
        }),
        ("config-not-json", |d| {
            std::fs::write(d.join("adapter_config.json"), "{not json").unwrap()
        }),
        ("config-rank-over-max", |d| {
            set_config(d, serde_json::json!({"r": 128}))
        }),
        ("config-dora", |d| {
            set_config(d, serde_json::json!({"use_dora": true}))
        }),
        ("config-selects-nothing", |d| {
            set_config(d, serde_json::json!({"target_modules": ["lm_head"]}))
        }),
        ("weights-missing", |d| {
            std::fs::remove_file(d.join("adapter_model.safetensors")).unwrap()
        }),
        ("weights-not-safetensors", |d| {
            std::fs::write(d.join("adapter_model.safetensors"), b"not safetensors").unwrap()
        }),
        ("weights-truncated", |d| {
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(d.join("adapter_model.safetensors"))
                .unwrap();
            let len = f.metadata().unwrap().len();
            f.set_len(len - 1).unwrap();
        }),
        ("weights-header-past-the-file", |d| {
            let p = d.join("adapter_model.safetensors");
            let mut bytes = std::fs::read(&p).unwrap();
            let len = bytes.len() as u64;
            bytes[..8].copy_from_slice(&len.to_le_bytes());
            std::fs::write(p, bytes).unwrap();
        }),
        ("tensor-not-a-projection", |d| {
            rename_tensor(d, Q0_A, "base_model.model.lm_head.lora_A.weight")
        }),
        ("tensor-layer-past-the-model", |d| {
            rename_tensor(d, Q0_A, &Q0_A.replace("layers.0.", "layers.99."))
        }),
        ("tensor-twice", |d| {
            rename_tensor(
                d,
                Q0_B,
                &Q0_A.replace("lora_A.weight", "lora_A.default.weight"),
            )
        }),
        ("tensor-shape", |d| {
            // As many values, another shape.
            let (h, _) = header(d);
            let shape: Vec<usize> = serde_json::from_value(h[Q0_A]["shape"].clone()).unwrap();
            let other = serde_json::json!([shape[0] * 2, shape[1] / 2]);
            set_tensor(d, Q0_A, "shape", other)
        }),
        ("tensor-type", |d| {
            // As many bytes, a type no load reads.
            set_tensor(d, Q0_A, "dtype", "I16".into())
        }),
    ]
}

/// The adapter of `dir` with one value of its first tensor made NaN: its configuration and
/// header pass the check, the load refuses its values.
fn poison(dir: &Path) {
    let (h, start) = header(dir);
    let first = h
        .values()
        .find(|t| t["data_offsets"][0] == 0)
        .expect("a tensor at the data's start");
    let nan: &[u8] = match first["dtype"].as_str().unwrap() {
        "BF16" => &[0xc0, 0x7f],
        "F16" => &[0x00, 0x7e],
        "F32" => &[0x00, 0x00, 0xc0, 0x7f],
        other => panic!("fixture dtype {other}"),
    };
    let path = dir.join("adapter_model.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[start..start + nan.len()].copy_from_slice(nan);
    std::fs::write(path, bytes).unwrap();
}

/// Regression: with memory full, room for a read was made before the files were read, so a
/// load that failed dropped an adapter for nothing (read again on its next request; under a
/// tenant's share, the tenant's own). Files a load would refuse for their configuration, their
/// header or their tensors' names, types and shapes are refused now before anything is
/// dropped: memory keeps the same adapters in the same least-recently-used order, nothing is
/// read, and each request gets the error it got before (the same HTTP status): an admin's
/// registration or replacement the load's reason (400), a reload or a found adapter the
/// server's failure (503), a directory's adapter without a configuration not found (404).
/// Then a valid adapter still makes its room and loads.
#[test]
fn files_a_load_would_refuse_drop_nothing_from_full_memory() {
    for (what, break_files) in caught_before_the_read() {
        let root = AdapterCopy::holding(
            &format!("early-{what}"),
            &["op", "found", "a", "b", "bad", "fine"],
        );
        let dir = |name: &str| root.0.join(name);
        let mut m = finder(16, 2, &[&root.0]);
        // op (an operator's) and found (a directory's) registered, then out of memory; a and
        // b in memory, a the most recently used.
        m.register("op", &dir("op")).expect("op");
        found(&mut m, "found").expect("found");
        found(&mut m, "a").expect("a");
        found(&mut m, "b").expect("b");
        m.resolve("a").expect("a");
        let before = (lru(&m), m.registry.list(), m.reads);
        assert_eq!(before.0, ["b", "a"], "{what}");
        for name in ["op", "found", "bad"] {
            break_files(&dir(name));
        }
        let unchanged = |m: &LoraManager, how: &str| {
            assert_eq!(lru(m), before.0, "{what}: {how}");
            assert_eq!(m.reads, before.2, "{what}: {how}: nothing read");
        };
        // An admin's registration and replacement: the load's reason, the client's 400.
        let e = m.register("new", &dir("bad")).expect_err("broken");
        assert!(matches!(e, LoraError::Load(_)), "{what}: {e:?}");
        unchanged(&m, "registration");
        let e = m.replace("a", &dir("bad")).expect_err("broken");
        assert!(matches!(e, LoraError::Load(_)), "{what}: {e:?}");
        unchanged(&m, "replacement");
        // A directory's adapter: the server's 503 (404 without a configuration: none found).
        let e = m.resolve("bad").expect_err("broken");
        match what {
            "config-missing" => assert!(matches!(e, LoraError::Unknown(_)), "{e:?}"),
            _ => assert!(
                matches!(&e, LoraError::Reload(n) if n == "bad"),
                "{what}: {e:?}"
            ),
        }
        unchanged(&m, "found");
        // Reloads: an operator's stays registered (503); a found one is unregistered, to be
        // found again as its directory says.
        let e = m.resolve("op").expect_err("broken");
        assert!(
            matches!(&e, LoraError::Reload(n) if n == "op"),
            "{what}: {e:?}"
        );
        unchanged(&m, "reload");
        assert!(m.registry.contains("op"));
        let e = m.resolve("found").expect_err("broken");
        match what {
            "config-missing" => assert!(matches!(e, LoraError::Unknown(_)), "{e:?}"),
            _ => assert!(
                matches!(&e, LoraError::Reload(n) if n == "found"),
                "{what}: {e:?}"
            ),
        }
        unchanged(&m, "reload of a found adapter");
        assert!(!m.registry.contains("found"));
        let mut listed = before.1.clone();
        listed.retain(|a| a.name != "found");
        assert_eq!(m.registry.list(), listed, "{what}");
        // A valid adapter makes its room (b, the least recently used, goes) and loads.
        read_starts(&m.registry);
        found(&mut m, "fine").expect("fine");
        assert_eq!(lru(&m), ["a", "fine"], "{what}");
        assert_eq!(m.reads, before.2 + 1, "{what}");
        assert_eq!(read_starts(&m.registry), [(1, true)], "{what}");
    }
}

/// The tenant's share: a load into full memory for a tenant whose share is full dropped the
/// tenant's own cached adapter before the read, even when the files were broken. Refused
/// now before that room is made (the server's 503, as before), the tenant's adapter kept.
#[test]
fn files_a_load_would_refuse_drop_none_of_the_tenant_s_adapters_from_full_memory() {
    let (root, mut m) = sharing("early-share", &["a1", "a2", "bad"], 1, &[("gold", 1)]);
    std::fs::write(root.0.join("bad/adapter_config.json"), "{not json").unwrap();
    let acme = charge("acme", "gold");
    m.resolve_for("a1", Some(&acme)).expect("a1");
    let reads = m.reads;
    let e = m.resolve_for("bad", Some(&acme)).expect_err("broken files");
    assert!(matches!(&e, LoraError::Reload(n) if n == "bad"), "{e:?}");
    assert_eq!((m.loaded(), m.reads), (vec!["a1".to_string()], reads));
    assert_eq!(owners(&m), [("a1".to_string(), Some("acme".to_string()))]);
    // A valid one makes its room in the share and in memory.
    m.resolve_for("a2", Some(&acme)).expect("a2");
    assert_eq!((m.loaded(), m.reads), (vec!["a2".to_string()], reads + 1));
}
