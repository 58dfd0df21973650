//! A unit test's scratch directory, removed with all it holds when its guard drops, so that a
//! test leaves nothing in the temporary directory whether it passes or fails (a failing
//! assertion's panic unwinds through the drop).
//!
//! One file for every crate whose tests write files (the unit tests of config, gpu, simulator
//! and the binary, the end-to-end tests' `tests/common` and `simulator/tests/simulate.rs`),
//! each including it as a test-only module by its path (`#[path]`): no crate of the workspace
//! lies below all of them, and a crate of its own for one guard would be more build than code.

// Each includer uses part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// A directory `sy-{name}-{pid}` in the temporary directory, removed with all it holds when
/// dropped. It reads as the [`Path`] it is.
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    /// Creates the directory, fresh and empty (after removing what a killed earlier run of
    /// this process id left there).
    pub fn new(name: &str) -> Self {
        let dir = Self::unmade(name);
        std::fs::create_dir_all(&dir.0).expect("a scratch directory");
        dir
    }

    /// The directory's path, not made (for a writer that creates it itself), removed when
    /// dropped all the same.
    pub fn unmade(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("sy-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Self(dir)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// The directory, no longer removed by this guard: for an owner that removes it itself.
    pub fn keep(mut self) -> PathBuf {
        std::mem::take(&mut self.0)
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

impl AsRef<std::ffi::OsStr> for ScratchDir {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.as_os_str()
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        // Empty once kept.
        if !self.0.as_os_str().is_empty() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
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
