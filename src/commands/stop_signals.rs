//! SIGINT and SIGTERM, taken over by a command that loads a model (`serve`, `run-batch`) just
//! before the load and watched until it ends.
//!
//! Until the handlers are installed a stop signal ends the process (the default action: no
//! message, nothing to clean up). From [`StopSignals::install`] on the process no longer ends
//! by itself, so every slow phase after it must watch the signals: the model load through
//! [`StopSignals::interruptible`], which runs the load on a thread of its own and returns
//! [`Interrupted`] at once when a signal comes (the load, holding no file the command writes,
//! is abandoned and ends with the process), and the command's own loop through
//! [`StopSignals::recv`]. One [`StopSignals`] is made per run and handed from the load to the
//! loop, so a signal that arrives in between (while the engine starts) is kept for the loop
//! rather than lost: tokio delivers a signal only to the listeners that exist when it arrives.
//!
//! A SIGINT the process inherited ignored stays ignored: a POSIX shell starts a
//! non-interactive shell's background jobs (`switchyard run-batch ... &` in a script) with
//! SIGINT and SIGQUIT ignored so that a Ctrl-C meant for the foreground does not reach them,
//! and the GNU coding standards (and Python, for its `KeyboardInterrupt`) leave such a signal
//! alone. tokio's `signal()` would install a handler regardless, so the disposition is read
//! first ([`inherited_ignored`]). SIGTERM is always handled: it is how a job is stopped on
//! purpose, and nothing ignores it by convention.
//!
//! A command that a signal stopped before it did its job (`run-batch`) returns an error
//! holding [`Interrupted`]; `main` ends the process with [`exit_status`], by that same signal
//! (as coreutils and Python do), so the shell reports 128 + its number (130 for SIGINT, 143
//! for SIGTERM) and a shell script running the command stops too, where a plain exit status
//! would let the script go on after a Ctrl-C. `serve`, whose normal way to stop is a signal,
//! returns no error then and exits 0.

use actix_web::rt::SystemRunner;
use anyhow::Context;
use tokio::signal::unix::{signal, Signal, SignalKind};

/// The stop signals' listeners.
pub(super) struct StopSignals {
    /// SIGINT (Ctrl-C); `None` when the process inherited it ignored.
    interrupt: Option<Signal>,
    /// SIGTERM.
    terminate: Signal,
}

/// A signal that stops a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StopSignal {
    /// SIGINT (Ctrl-C).
    Interrupt,
    /// SIGTERM.
    Terminate,
}

impl StopSignal {
    /// The signal's name (`SIGINT`, `SIGTERM`).
    pub(super) fn name(self) -> &'static str {
        match self {
            Self::Interrupt => "SIGINT",
            Self::Terminate => "SIGTERM",
        }
    }

    /// The signal's number.
    fn number(self) -> libc::c_int {
        match self {
            Self::Interrupt => libc::SIGINT,
            Self::Terminate => libc::SIGTERM,
        }
    }
}

/// A stop signal ended what was under way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Interrupted {
    /// The signal that came.
    pub(super) signal: StopSignal,
}

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "interrupted ({})", self.signal.name())
    }
}

impl std::error::Error for Interrupted {}

/// The [`Interrupted`] in `err`'s chain (as the error itself, or under a context), if any.
pub(super) fn interruption(err: &anyhow::Error) -> Option<Interrupted> {
    err.chain()
        .find_map(|e| e.downcast_ref::<Interrupted>().copied())
}

/// How the process ends after `err` ended its command (`err` already reported): by the
/// signal of the [`Interrupted`] in its chain, if there is one, else with status 1.
///
/// Ending by the signal (its handler reset to the default, then raised) is what the shell
/// sees as 128 + its number, and what tells a calling shell script that its child was
/// interrupted. Where the default action does not end the process (PID 1 of a container
/// ignores it), the status is 128 + the number all the same.
pub fn exit_status(err: &anyhow::Error) -> std::process::ExitCode {
    let Some(stop) = interruption(err) else {
        return std::process::ExitCode::FAILURE;
    };
    // Nothing runs after the signal: what is buffered for standard output (`run-batch -o -`)
    // is written now.
    let _ = std::io::Write::flush(&mut std::io::stdout());
    let number = stop.signal.number();
    // SAFETY: `signal` and `raise` take a valid signal number and the default disposition;
    // they touch no memory of this process. The handler replaced is tokio's, whose listeners
    // are all gone by now.
    unsafe {
        libc::signal(number, libc::SIG_DFL);
        libc::raise(number);
    }
    // 130 or 143. Not by returning: the load may still run on its abandoned thread (see
    // `exit_now`).
    exit_now(128 + number)
}

/// Ends the process at once with `status`, running no exit handlers, after flushing standard
/// output and error. For a command whose model load a signal abandoned
/// ([`StopSignals::interruptible`]): the load goes on on its thread, possibly inside the CUDA
/// libraries, whose exit handlers would tear them down under it (on an H100 a `serve` stopped
/// early in a CUDA load ended in glibc's "malloc_consolidate(): unaligned fastbin chunk
/// detected" abort that way; gpu/CUDA_NOTES.md v65). The kernel closes the files the process
/// holds and releases their locks; the GPU driver frees its memory.
pub(super) fn exit_now(status: i32) -> ! {
    let _ = std::io::Write::flush(&mut std::io::stdout());
    let _ = std::io::Write::flush(&mut std::io::stderr());
    // SAFETY: `_exit` takes any status and ends the process; nothing of Rust's runs after it.
    unsafe { libc::_exit(status) }
}

/// From here on a SIGINT or SIGTERM ends the process at once, by that signal, after one line
/// on standard error: for the last wait of a command whose work is over (the backend's
/// release, [`super::serve`]'s `stop_engine`), which a step stuck on the GPU could make last,
/// and where the command's own listeners are gone with its runtime (a signal reaching them
/// would be swallowed). Ending by the default action runs no exit handlers (the CUDA
/// libraries' among them), so it is safe with the backend still alive. A SIGINT still ignored
/// (inherited so, see the module's docs) stays ignored.
pub(super) fn end_at_next_stop() {
    for signal in [libc::SIGINT, libc::SIGTERM] {
        if signal == libc::SIGINT && inherited_ignored(signal) {
            continue;
        }
        // SAFETY: a zeroed `sigaction` is a valid value of that plain C struct; the handler is
        // an `extern "C"` function that calls only async-signal-safe functions (`write`,
        // `signal`, `raise`), and `sigaction` replaces the disposition of a valid signal
        // number (tokio's handler, whose listeners are gone with the runtime).
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = end_now as extern "C" fn(libc::c_int) as libc::sighandler_t;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut());
        }
    }
}

/// The handler [`end_at_next_stop`] installs: says so, then ends the process by `signal`
/// (blocked while this handler runs: raised, then unblocked, it is delivered under the
/// default action at once). Where that does not end the process (PID 1 of a PID namespace,
/// which the kernel spares a signal under the default action, drops it), the handler ends it
/// with 128 + the signal's number, the status [`exit_status`] falls back to there too: it
/// must not return, or the wait it was to cut short would go on.
extern "C" fn end_now(signal: libc::c_int) {
    let message: &[u8] = if signal == libc::SIGINT {
        b"switchyard: SIGINT: ending now, without waiting for the backend to be released\n"
    } else {
        b"switchyard: SIGTERM: ending now, without waiting for the backend to be released\n"
    };
    // SAFETY: `write` of a static buffer to standard error, `signal` with the default
    // disposition, `raise`, the `sigset_t` functions on a set of this frame, `pthread_sigmask`
    // and `_exit` are async-signal-safe and touch no other memory of the process.
    unsafe {
        libc::write(2, message.as_ptr().cast(), message.len());
        libc::signal(signal, libc::SIG_DFL);
        libc::raise(signal);
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, signal);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        libc::_exit(128 + signal);
    }
}

/// Whether `signal` is ignored, as the process inherited it where nothing has installed a
/// handler for it yet (see the module's docs).
fn inherited_ignored(signal: libc::c_int) -> bool {
    // SAFETY: a zeroed `sigaction` is a valid value of that plain C struct, and `sigaction`
    // with no new action only writes the current one into `old`, which lives here.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        libc::sigaction(signal, std::ptr::null(), &mut old) == 0
            && old.sa_sigaction == libc::SIG_IGN
    }
}

impl StopSignals {
    /// Installs the handlers on `system`'s runtime: from here on SIGINT and SIGTERM reach
    /// these listeners instead of ending the process. A SIGINT the process inherited ignored
    /// is left ignored (see the module's docs).
    pub(super) fn install(system: &SystemRunner) -> anyhow::Result<Self> {
        let watch_interrupt = !inherited_ignored(libc::SIGINT);
        if !watch_interrupt {
            tracing::debug!(
                "SIGINT was inherited ignored (a background job's): only SIGTERM stops"
            );
        }
        system.block_on(async {
            Ok(Self {
                interrupt: if watch_interrupt {
                    Some(
                        signal(SignalKind::interrupt())
                            .context("cannot install the SIGINT handler")?,
                    )
                } else {
                    None
                },
                terminate: signal(SignalKind::terminate())
                    .context("cannot install the SIGTERM handler")?,
            })
        })
    }

    /// The next stop signal, once it comes (one sent before it is awaited, after
    /// [`Self::install`], counts).
    pub(super) async fn recv(&mut self) -> Interrupted {
        let Self {
            interrupt,
            terminate,
        } = self;
        // An ignored SIGINT never comes.
        let interrupt = async {
            match interrupt {
                Some(listener) => listener.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = interrupt => Interrupted { signal: StopSignal::Interrupt },
            _ = terminate.recv() => Interrupted { signal: StopSignal::Terminate },
        }
    }

    /// Runs `work` (the model load) on a thread of its own named `name` and returns its
    /// result, or [`Interrupted`] as soon as a stop signal comes. The abandoned work runs on
    /// until the process ends, which the caller does next: it must hold nothing the caller
    /// would have to clean up.
    pub(super) fn interruptible<T, F>(
        &mut self,
        system: &SystemRunner,
        name: &str,
        work: F,
    ) -> anyhow::Result<T>
    where
        T: Send + 'static,
        F: FnOnce() -> anyhow::Result<T> + Send + 'static,
    {
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name(name.to_owned())
            // The stack the work had on the main thread (Linux's usual 8 MiB), not a spawned
            // thread's 2 MiB: the load parses files (a chat template among them) that are
            // hostile input, within recursion bounds set for a main thread's stack.
            .stack_size(8 << 20)
            .spawn(move || {
                // The receiver is gone only when a signal ended the wait.
                let _ = tx.send(work());
            })
            .with_context(|| format!("cannot start the {name} thread"))?;
        system.block_on(async {
            tokio::select! {
                done = rx => done.map_err(|_| {
                    anyhow::anyhow!("the {name} thread ended without a result (it panicked)")
                })?,
                stop = self.recv() => Err(stop.into()),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// Sends this process `flag`'s signal (`-INT`, `-TERM`) as an operator would.
    fn kill(flag: &str) {
        let status = std::process::Command::new("kill")
            .arg(flag)
            .arg(std::process::id().to_string())
            .status()
            .expect("run kill");
        assert!(status.success());
    }

    /// One test, so that no other test of this binary waits on these signals meanwhile.
    #[test]
    fn a_signal_during_the_work_ends_the_wait_and_a_later_one_is_kept_for_the_loop() {
        // The test run may have inherited SIGINT ignored (started in the background of a
        // script), which `install` would keep: this test is about a SIGINT that comes.
        // SAFETY: a plain system call; no other test of this binary handles SIGINT.
        unsafe {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
        }
        let system = actix_web::rt::System::new();
        let mut stops = StopSignals::install(&system).unwrap();
        // Work that runs until it is let go: the signal surely comes while it runs.
        let (release, held) = mpsc::channel::<()>();
        let err = stops
            .interruptible(&system, "test-load", move || {
                kill("-INT");
                let _ = held.recv();
                Ok(())
            })
            .unwrap_err();
        assert_eq!(
            err.downcast_ref::<Interrupted>(),
            Some(&Interrupted {
                signal: StopSignal::Interrupt
            })
        );
        drop(release);
        // Work that ends first returns its result.
        let value = stops.interruptible(&system, "test-load", || Ok(7)).unwrap();
        assert_eq!(value, 7);
        // A signal sent before the loop awaits it is not lost.
        kill("-TERM");
        let stop = system.block_on(stops.recv());
        assert_eq!(
            stop,
            Interrupted {
                signal: StopSignal::Terminate
            }
        );

        // Work that fails, or panics, is an error, not an interruption.
        let err = stops
            .interruptible::<(), _>(&system, "test-load", || anyhow::bail!("no such model"))
            .unwrap_err();
        assert_eq!(err.to_string(), "no such model");
        let err = stops
            .interruptible::<(), _>(&system, "test-load", || panic!("a bug"))
            .unwrap_err();
        assert!(err.downcast_ref::<Interrupted>().is_none());
        assert!(err.to_string().contains("panicked"), "{err}");
    }

    #[test]
    fn an_interruption_is_found_under_the_contexts_a_command_adds() {
        let stop = Interrupted {
            signal: StopSignal::Terminate,
        };
        let err = anyhow::Error::new(stop).context("run-batch stopped after 3 of 10 lines");
        assert_eq!(interruption(&err), Some(stop));
        assert_eq!(
            format!("{err:#}"),
            "run-batch stopped after 3 of 10 lines: interrupted (SIGTERM)"
        );
        let err = anyhow::Error::new(stop).context("inner").context("outer");
        assert_eq!(interruption(&err), Some(stop));
        // Another error, or one that only names a signal in its text, is no interruption.
        assert_eq!(interruption(&anyhow::anyhow!("interrupted (SIGINT)")), None);
        let io = std::io::Error::new(std::io::ErrorKind::Interrupted, "EINTR");
        assert_eq!(interruption(&anyhow::Error::new(io).context("read")), None);
        assert_eq!(StopSignal::Interrupt.number(), 2);
        assert_eq!(StopSignal::Terminate.number(), 15);
    }

    /// SIGUSR2, which nothing in this binary uses, stands for an inherited SIGINT: this
    /// process's own SIGINT has tokio's handler once the test above ran.
    #[test]
    fn an_ignored_disposition_is_read_as_ignored_and_a_default_one_is_not() {
        let signal = libc::SIGUSR2;
        assert!(!inherited_ignored(signal));
        // SAFETY: sets and restores the disposition of a signal nothing else here uses.
        let previous = unsafe { libc::signal(signal, libc::SIG_IGN) };
        let ignored = inherited_ignored(signal);
        unsafe { libc::signal(signal, previous) };
        assert!(ignored);
        assert!(!inherited_ignored(signal));
    }
}
