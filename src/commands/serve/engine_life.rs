//! The engine's life in a command that loads a model (`serve`, `run-batch`): [`run_engine`]
//! runs the command's work and ends the engine with [`stop_engine`], which waits for the
//! executor's thread to release the backend before the process may end (see the
//! `BackendReleased` invariant in ARCHITECTURE.md).

use std::time::Duration;

use switchyard_actors::actors::BackendReleased;

use crate::commands::stop_signals;

/// How long a command waits, once its actix system is gone, for the executor's thread to drop
/// the backend ([`stop_engine`]): a CUDA backend frees its memory, streams and context, well
/// under a second on an H100; a step under way ends first.
const BACKEND_RELEASE_WAIT: Duration = Duration::from_secs(30);

/// How long [`stop_engine`] waits for the backend before it says that it waits.
const BACKEND_RELEASE_NOTICE: Duration = Duration::from_secs(2);

/// Runs `run` (the engine's life: [`start_engine`] in `system`, then the work) and ends the
/// engine with [`stop_engine`], given the [`BackendReleased`] that `run` left in its second
/// argument. A panic out of `run` goes on only after that, so that no path ends the process
/// with the backend alive on the executor's thread (the panic's message is printed as it
/// happens; the exit handlers run once it reaches `main`).
pub(in crate::commands) fn run_engine<T>(
    system: actix_web::rt::SystemRunner,
    run: impl FnOnce(&actix_web::rt::SystemRunner, &mut Option<BackendReleased>) -> T,
) -> T {
    let mut released = None;
    let ran =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&system, &mut released)));
    stop_engine(system, released);
    match ran {
        Ok(value) => value,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

/// Ends the engine [`start_engine`] started in `system`: drops the system (the engine's
/// actors with it) and waits, at most [`BACKEND_RELEASE_WAIT`], for the executor's thread to
/// drop the backend, so the process ends after it (a CUDA backend still alive on that thread
/// while the exit handlers tear the CUDA libraries down ended `run-batch` with a SIGSEGV on an
/// H100, gpu/CUDA_NOTES.md v65). `released` is what `start_engine` left: none if the engine
/// never started (the backend then went with the load's values, on this thread).
///
/// The command's work is over by then, and its signal listeners are gone with the system: a
/// SIGINT or SIGTERM during the wait ends the process at once, by that signal
/// ([`stop_signals::end_at_next_stop`]), so a step stuck on the GPU does not hold it for the
/// whole wait, and a wait that lasts past [`BACKEND_RELEASE_NOTICE`] says so, naming the
/// backend call that holds the release ([`release_holder`]), as does its give-up. The handler
/// is installed before the system is dropped, so no signal falls between the listeners'
/// going and its coming.
fn stop_engine(system: actix_web::rt::SystemRunner, released: Option<BackendReleased>) {
    let Some(released) = released else {
        drop(system);
        return;
    };
    stop_signals::end_at_next_stop();
    drop(system);
    if released.wait(BACKEND_RELEASE_NOTICE) {
        return;
    }
    tracing::info!(
        wait_s = BACKEND_RELEASE_WAIT.as_secs(),
        "waiting for the backend to be released ({}); SIGINT or SIGTERM ends the process now",
        release_holder(&released)
    );
    if !released.wait(BACKEND_RELEASE_WAIT.saturating_sub(BACKEND_RELEASE_NOTICE)) {
        tracing::warn!(
            wait_s = BACKEND_RELEASE_WAIT.as_secs(),
            "the backend was not released in time ({}); exiting regardless",
            release_holder(&released)
        );
    }
}

/// What keeps the backend from being released, as [`stop_engine`]'s log lines say it: the
/// backend call the executor's thread is in (a step not yet returned, or the backend's own
/// drop, stuck on the device), or that it is in none.
fn release_holder(released: &BackendReleased) -> String {
    match released.holder() {
        Some(call) => format!("{call}"),
        None if released.is_released() => "released just now".into(),
        None => "the executor's thread is in no backend call".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use parking_lot::Mutex;
    use switchyard_actors::actors::{Engine as ActorEngine, EngineConfig};
    use switchyard_gpu::model::Tokenizer;
    use switchyard_policies::{PolicyRegistry, SchedulerConfig};

    use crate::commands::stop_signals::StopSignals;
    use crate::pid_namespaces::pid_namespaces_work;
    /// A backend that takes `takes` to drop (a CUDA backend frees its memory, streams and
    /// context; a step stuck on the GPU holds it longer), then sets `dropped`; it never runs a
    /// step.
    struct SlowDrop {
        dropped: Arc<AtomicBool>,
        takes: Duration,
    }

    impl Drop for SlowDrop {
        fn drop(&mut self) {
            std::thread::sleep(self.takes);
            self.dropped.store(true, Ordering::SeqCst);
        }
    }

    impl switchyard_gpu::backend::Backend for SlowDrop {
        fn name(&self) -> &str {
            "slow-drop"
        }
        fn num_kv_blocks(&self) -> usize {
            64
        }
        fn block_size(&self) -> usize {
            4
        }
        fn max_batch_tokens(&self) -> usize {
            64
        }
        fn execute(
            &mut self,
            _: &switchyard_gpu::backend::Batch,
        ) -> Result<Vec<switchyard_gpu::backend::SeqOutput>, switchyard_gpu::GpuError> {
            Err(switchyard_gpu::GpuError::Internal(
                "no step runs here".into(),
            ))
        }
        fn release(&mut self, _: u64) {}
    }

    /// Regression: a panic out of the engine's run (serve's or run-batch's `block_on`)
    /// unwound past `stop_engine`, so the process ended with the backend still alive on the
    /// executor's thread (what gpu/CUDA_NOTES.md v65 saw crash at exit). It goes on only once
    /// the backend is dropped.
    /// An engine on `backend` with a one-word tokenizer and `fcfs`, started in the current
    /// actix system.
    fn start_test_engine(backend: Box<dyn switchyard_gpu::backend::Backend>) -> ActorEngine {
        let json = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
            "normalizer":null,"pre_tokenizer":null,"post_processor":null,"decoder":null,
            "model":{"type":"WordLevel","vocab":{"a":0,"b":1},"unk_token":"a"}}"#;
        let tokenizer = Arc::new(Tokenizer::from_json_bytes(json.as_bytes()).unwrap());
        let config = EngineConfig {
            scheduler: SchedulerConfig {
                num_gpu_blocks: 64,
                block_size: 4,
                max_model_len: 256,
                ..SchedulerConfig::default()
            },
            hash_key: [1, 2],
            tokenizer_threads: 1,
            max_pending_requests: 16,
            tier_max_pending: Vec::new(),
            tier_max_pending_per_tenant: Vec::new(),
            metrics_tenants: Default::default(),
            async_scheduling: switchyard_actors::AsyncScheduling::Off,
            lora: None,
            vocab_size: 2,
            prefix_sharing_by_tenant: true,
            message_tokens_as_text: true,
            step_timeout: None,
        };
        let policy = PolicyRegistry::with_builtins()
            .create("fcfs", &serde_yaml::Value::Null, &[])
            .unwrap();
        ActorEngine::start(config, backend, tokenizer, None, policy).unwrap()
    }

    /// The test `name` of this binary, run alone in a child process told so by
    /// [`IN_CHILD`] (a test whose engine ends without its backend released installs
    /// process-wide signal handlers, see `stop_engine`, which the other tests' signals must
    /// not meet); `signal` is sent to the child every 100 ms from the time it writes
    /// [`CHILD_READY`] on standard error until it ends, if given. With `as_pid1` the child
    /// runs as PID 1 of a new user and PID namespace (`unshare -Urpf`, see
    /// [`pid_namespaces_work`]), as a container's entry point runs: the process started is
    /// `unshare`'s, which exits with its child's exit code, and the signal goes to its child.
    /// The child's status and standard error.
    fn run_in_child(
        name: &str,
        signal: Option<&str>,
        as_pid1: bool,
    ) -> (std::process::ExitStatus, String) {
        let test = std::env::current_exe().unwrap();
        let mut command = if as_pid1 {
            let mut unshare = std::process::Command::new("unshare");
            // `--kill-child`: the test killed, its child goes too.
            unshare.args(["-Urpf", "--kill-child"]).arg(&test);
            unshare
        } else {
            std::process::Command::new(&test)
        };
        let mut child = command
            .args([
                "--exact",
                &format!("commands::serve::engine_life::tests::{name}"),
                "--nocapture",
                "--test-threads=1",
            ])
            .env(IN_CHILD, name)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = Arc::new(Mutex::new(String::new()));
        let reader = {
            let stderr = Arc::clone(&stderr);
            let mut pipe = std::io::BufReader::new(child.stderr.take().unwrap());
            std::thread::spawn(move || {
                let mut line = String::new();
                while std::io::BufRead::read_line(&mut pipe, &mut line).unwrap_or(0) > 0 {
                    stderr.lock().push_str(&line);
                    line.clear();
                }
            })
        };
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if let Some(signal) = signal {
                if stderr.lock().contains(CHILD_READY) {
                    let pid = if as_pid1 {
                        // `unshare`'s one child, the test's process: it wrote on stderr.
                        let id = child.id();
                        std::fs::read_to_string(format!("/proc/{id}/task/{id}/children"))
                            .unwrap_or_default()
                            .trim()
                            .to_owned()
                    } else {
                        child.id().to_string()
                    };
                    let _ = std::process::Command::new("kill")
                        .args([signal, &pid])
                        .status();
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        reader.join().unwrap();
        let stderr = stderr.lock().clone();
        (status, stderr)
    }

    /// What a child of [`run_in_child`] writes on standard error once signals may come.
    const CHILD_READY: &str = "child ready for signals";

    /// Names the test a child process of [`run_in_child`] runs.
    const IN_CHILD: &str = "SWITCHYARD_TEST_IN_CHILD";

    /// Whether this process is the child that runs test `name`.
    fn is_child_for(name: &str) -> bool {
        std::env::var_os(IN_CHILD).is_some_and(|v| v == name)
    }

    #[test]
    fn a_panic_in_the_engines_run_goes_on_once_the_backend_is_released() {
        const NAME: &str = "a_panic_in_the_engines_run_goes_on_once_the_backend_is_released";
        if !is_child_for(NAME) {
            let (status, stderr) = run_in_child(NAME, None, false);
            assert!(status.success(), "{status:?}: {stderr}");
            return;
        }
        let dropped = Arc::new(AtomicBool::new(false));
        let backend = Box::new(SlowDrop {
            dropped: dropped.clone(),
            takes: Duration::from_millis(300),
        });
        let system = actix_web::rt::System::new();
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run_engine(system, |system, released| {
                system.block_on(async {
                    let engine = start_test_engine(backend);
                    *released = Some(engine.backend_released());
                    panic!("a bug in the engine's run");
                })
            })
        }));
        let payload = panicked.expect_err("the panic comes through");
        assert_eq!(
            payload.downcast_ref::<&str>(),
            Some(&"a bug in the engine's run")
        );
        assert!(
            dropped.load(Ordering::SeqCst),
            "the panic came out before the executor's thread dropped the backend"
        );
    }

    /// A stop signal while the command waits for a backend that is not released (a step stuck
    /// on the GPU) ends the process at once, by that signal, where the command's own
    /// listeners, gone with the runtime, swallowed it (the wait ran its 30 s). The child
    /// starts an engine whose backend takes a minute to drop, with the stop signals'
    /// listeners installed as `serve` and `run-batch` have them, and ends it; the parent
    /// sends SIGTERM until the child is gone (those sent before the wait began are
    /// swallowed, as they were everywhere).
    #[test]
    fn a_stop_signal_during_the_wait_for_the_backend_ends_the_process_at_once() {
        use std::os::unix::process::ExitStatusExt;
        const NAME: &str = "a_stop_signal_during_the_wait_for_the_backend_ends_the_process_at_once";
        if !is_child_for(NAME) {
            let (status, stderr) = run_in_child(NAME, Some("-TERM"), false);
            assert_eq!(status.signal(), Some(libc::SIGTERM), "{status:?}: {stderr}");
            assert_ended_by_the_handler(&stderr);
            return;
        }
        let system = actix_web::rt::System::new();
        let _stops = StopSignals::install(&system).unwrap();
        eprintln!("{CHILD_READY}");
        let backend = Box::new(SlowDrop {
            dropped: Arc::new(AtomicBool::new(false)),
            takes: Duration::from_secs(60),
        });
        run_engine(system, |system, released| {
            system.block_on(async {
                *released = Some(start_test_engine(backend).backend_released());
            })
        });
        // Reached only once the wait gave up (30 s): the signals did not end it.
        eprintln!("the wait ended without the signals");
    }

    /// The child's standard error says that the stop handler of the wait ended it (not the
    /// wait's end).
    fn assert_ended_by_the_handler(stderr: &str) {
        assert!(
            stderr.contains(
                "switchyard: SIGTERM: ending now, without waiting for the backend to be released"
            ),
            "{stderr}"
        );
        assert!(!stderr.contains("without the signals"), "{stderr}");
    }

    /// The same as PID 1 of a PID namespace (a container's entry point), which the kernel
    /// spares a signal under the default action: the handler's raise does not end the
    /// process, its fallback does, with the status a shell reports for the signal (143).
    /// Before that fallback the handler returned and the wait went on. Where this machine
    /// makes no user and PID namespace (`unshare -Urpf true` fails: unprivileged user
    /// namespaces off), the test says so on stderr and checks nothing.
    #[test]
    fn a_stop_signal_during_the_wait_for_the_backend_ends_a_pid_1_process_at_once() {
        if !pid_namespaces_work() {
            return;
        }
        let (status, stderr) = run_in_child(
            "a_stop_signal_during_the_wait_for_the_backend_ends_the_process_at_once",
            Some("-TERM"),
            true,
        );
        assert_eq!(status.code(), Some(143), "{status:?}: {stderr}");
        assert_ended_by_the_handler(&stderr);
    }

    /// A backend whose release hangs (its drop stuck on the device) is named in the wait's
    /// log lines as the drop that holds it, with its time, where the log said only that a
    /// step under way ends first.
    #[test]
    fn the_wait_for_the_backend_names_a_stuck_drop() {
        let system = actix_web::rt::System::new();
        let released = system.block_on(async {
            start_test_engine(Box::new(SlowDrop {
                dropped: Arc::new(AtomicBool::new(false)),
                takes: Duration::from_secs(60),
            }))
            .backend_released()
        });
        assert_eq!(
            release_holder(&released),
            "the executor's thread is in no backend call"
        );
        drop(system);
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while released.holder().is_none() {
            assert!(std::time::Instant::now() < deadline, "no drop within 30 s");
            std::thread::sleep(Duration::from_millis(10));
        }
        let said = release_holder(&released);
        assert!(
            said.starts_with("the backend's drop call, under way for "),
            "{said}"
        );
        assert!(!released.is_released());
    }
}
