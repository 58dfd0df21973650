//! A unit test's scratch directory, removed with all it holds when its guard drops, so that a
//! test leaves nothing in the temporary directory whether it passes or fails (a failing
//! assertion's panic unwinds through the drop).
//!
//! One file for every crate whose unit tests write files (config, gpu, simulator and the
//! binary), each including it as a test-only module by its path (`#[path]`): no crate of the
//! workspace lies below all of them, and a crate of its own for one guard would be more
//! build than code.

use std::path::{Path, PathBuf};

/// A fresh, empty directory `sy-{name}-{pid}` in the temporary directory, removed when
/// dropped. It reads as the [`Path`] it is.
pub(crate) struct ScratchDir(PathBuf);

impl ScratchDir {
    /// Creates the directory (after removing what a killed earlier run of this process id
    /// left there).
    pub(crate) fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("sy-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        Self(dir)
    }
}

impl std::ops::Deref for ScratchDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for ScratchDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::ScratchDir;

    #[test]
    fn the_directory_is_removed_with_its_files_when_its_test_fails() {
        let mut path = None;
        let failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let dir = ScratchDir::new("scratch-guard");
            std::fs::create_dir_all(dir.join("sub")).unwrap();
            std::fs::write(dir.join("sub/f"), "x").unwrap();
            path = Some(dir.to_path_buf());
            panic!("a failing assertion");
        }));
        assert!(failed.is_err());
        let path = path.expect("the directory was made");
        assert!(!path.exists(), "{} is left", path.display());
    }
}
