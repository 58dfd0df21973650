//! `switchyard` as PID 1 of a new user and PID namespace, as a container's entry point runs,
//! for the tests of how it stops there.

use super::with_default_sigint;
use std::process::{Child, Command};

/// The `switchyard` binary as PID 1 of a new user and PID namespace, as a command to add
/// arguments to: `unshare -Urpf --kill-child switchyard`, which needs no privilege where
/// unprivileged user namespaces are allowed (see [`pid_namespaces_work`]). A PID namespace's
/// init, as a container's entry point is, is spared by the kernel every signal it has no
/// handler for (pid_namespaces(7)): a stop signal sent from this, the parent, namespace
/// reaches it only once the binary handles it, and the signal the binary raises at itself
/// under the default disposition does not end it.
///
/// The process spawned is `unshare`'s: it starts the binary as its child (whose host PID
/// [`namespace_init`] reads), waits for it, and exits with the code the child exited with
/// (a child that a signal ended, which for a namespace's init only SIGKILL can, gives no such
/// code: util-linux 2.38.1's `unshare` then fails with 1, "sigprocmask unblock failed").
/// `--kill-child`: a test that kills the `unshare` process (a deadline's kill, a
/// [`super::Server`]'s drop) kills the binary, and with it the namespace, too. Like
/// [`super::switchyard`]'s, the binary starts with SIGINT's default disposition (`unshare`
/// passes its own on to its child).
pub fn switchyard_as_pid1() -> Command {
    let mut cmd = with_default_sigint(Command::new("unshare"));
    cmd.args(["-Urpf", "--kill-child", env!("CARGO_BIN_EXE_switchyard")]);
    cmd
}

#[path = "../../testsupport/pid_namespaces.rs"]
mod pid_namespaces;
/// Whether [`switchyard_as_pid1`] can run here: `unshare -Urpf true` succeeds. Where it does
/// not, this says so on stderr (`SKIPPED`), and the PID-1 tests return without checking
/// anything.
#[allow(unused_imports)] // Only the test files with PID-1 tests use it, as with `dead_code`.
pub use pid_namespaces::pid_namespaces_work;

/// The host PID of `unshare`'s child, which runs as PID 1 of its PID namespace (checked on
/// its `NSpid` line): the process to signal. Ask once the child has shown that it runs (a log
/// line, an output written), so that it is the binary and no longer `unshare`'s fork of
/// itself.
pub fn namespace_init(unshare: &Child) -> u32 {
    let id = unshare.id();
    let children = std::fs::read_to_string(format!("/proc/{id}/task/{id}/children"))
        .expect("unshare's children");
    let pids: Vec<u32> = children
        .split_whitespace()
        .map(|p| p.parse().expect("a pid"))
        .collect();
    let [pid] = pids[..] else {
        panic!("unshare has children {pids:?}, not one");
    };
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    let nspid = status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .expect("an NSpid line");
    assert_eq!(
        nspid.split_whitespace().last(),
        Some("1"),
        "PID {pid} is not its namespace's PID 1: NSpid:{nspid}"
    );
    pid
}
