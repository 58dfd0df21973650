//! Start-up checks of `serve` that need the file system or the model, and what it says about
//! an open API.

use std::net::SocketAddr;
use std::path::Path;

use switchyard_config::LoadFormat;

/// The listening socket on `addr`, bound as actix-web binds its own (address reuse, a backlog
/// of 1024) but before the model loads, so that an address in use fails at once. An error
/// names the setting at fault: `server.host` for an address not assignable here,
/// `server.port` otherwise, with `origin` (where its value comes from: `config.yaml:10`, an
/// override); `origin` is asked for the field only on failure.
pub(super) fn listen(
    addr: SocketAddr,
    origin: impl Fn(&str) -> String,
) -> anyhow::Result<std::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let bind = || -> std::io::Result<std::net::TcpListener> {
        let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
        socket.set_reuse_address(true)?;
        socket.bind(&addr.into())?;
        socket.listen(1024)?;
        Ok(socket.into())
    };
    bind().map_err(|e| {
        let (field, value) = match e.kind() {
            std::io::ErrorKind::AddrNotAvailable => ("server.host", addr.ip().to_string()),
            _ => ("server.port", addr.port().to_string()),
        };
        anyhow::anyhow!(
            "{field} {value} ({}): cannot listen on {addr}: {}",
            origin(field),
            io_reason(&e)
        )
    })
}

/// An I/O error's reason in lower case, without the `(os error N)` the operator has no use for.
fn io_reason(e: &std::io::Error) -> String {
    let text = e.to_string();
    let text = match text.find(" (os error") {
        Some(at) => text[..at].to_string(),
        None => text,
    };
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_lowercase().chain(chars).collect(),
        None => text,
    }
}

/// Refuses a `model.load_format` that names another format than the one at `path` (`auto`
/// takes what is there).
pub(super) fn load_format(configured: LoadFormat, path: &Path) -> anyhow::Result<()> {
    let name = |f: LoadFormat| match f {
        LoadFormat::Auto => "auto",
        LoadFormat::Gguf => "gguf",
        LoadFormat::Safetensors => "safetensors",
        LoadFormat::Dummy => "dummy",
    };
    // A missing path is the loader's to report.
    if matches!(configured, LoadFormat::Auto) || !path.exists() {
        return Ok(());
    }
    let found = if switchyard_gpu::model::is_hf_checkpoint(path) {
        LoadFormat::Safetensors
    } else {
        LoadFormat::Gguf
    };
    anyhow::ensure!(
        configured == found,
        "model.load_format is {} but {} holds a {} model (set load_format: {} or auto)",
        name(configured),
        path.display(),
        name(found),
        name(found)
    );
    Ok(())
}

/// The longest sequence served: `model.max_model_len` when set, which may not exceed the
/// model's context (positions past it were never trained; vLLM refuses it too), else the
/// context.
pub(super) fn max_model_len(
    configured: Option<usize>,
    context: usize,
    path: &Path,
) -> anyhow::Result<usize> {
    match configured {
        Some(n) if n > context => anyhow::bail!(
            "model.max_model_len is {n}, more than the {context} tokens of context of {}: \
             lower it to at most {context} or leave it out",
            path.display()
        ),
        Some(n) => Ok(n),
        None => Ok(context),
    }
}

/// The longest sequence served once the KV cache is sized (`num_blocks` blocks of
/// `block_size` tokens): a sequence the cache cannot hold alone could never run, so, as vLLM
/// does, a configured `model.max_model_len` (`configured`) beyond the cache is refused, naming
/// both numbers and what to change; the model's own context is lowered to what the cache holds,
/// with a warning. Under a sliding window (`window`, steps of at most `max_chunk` tokens) a
/// sequence holds at most so many blocks at once, so any length fits a cache of that many
/// ([`switchyard_policies::kv_capacity_tokens`]).
pub(super) fn fit_kv_cache(
    max_model_len: usize,
    configured: bool,
    (num_blocks, block_size): (usize, usize),
    max_chunk: usize,
    window: Option<switchyard_policies::SlidingWindow>,
) -> anyhow::Result<usize> {
    if max_model_len
        <= switchyard_policies::kv_capacity_tokens(num_blocks, block_size, max_chunk, window)
    {
        return Ok(max_model_len);
    }
    let capacity = num_blocks.saturating_mul(block_size);
    let remedy = "raise cache.kv_cache_mb (CPU backend) or cache.gpu_memory_utilization \
                  (CUDA backend), or set cache.num_blocks higher";
    anyhow::ensure!(
        !configured,
        "model.max_model_len is {max_model_len} tokens, more than the {capacity} tokens the KV \
         cache holds ({num_blocks} blocks of {block_size}): {remedy}, or lower \
         model.max_model_len to at most {capacity}"
    );
    tracing::warn!(
        context = max_model_len,
        kv_cache_tokens = capacity,
        "the model's context of {max_model_len} tokens is more than the {capacity} tokens the \
         KV cache holds ({num_blocks} blocks of {block_size}): serving max_model_len \
         {capacity}; {remedy} to serve the whole context"
    );
    Ok(capacity)
}

/// Says so at start when the API takes no key: a warning on a loopback address, an error
/// where other hosts may reach it.
pub(super) fn warn_if_open(open: bool, bind: SocketAddr) {
    if !open {
        return;
    }
    if bind.ip().is_loopback() {
        tracing::warn!(
            %bind,
            "no API keys (server.api_keys, server.api_keys_file): the API is open to every \
             local user"
        );
    } else {
        tracing::error!(
            %bind,
            "no API keys (server.api_keys, server.api_keys_file) on a non-loopback address: \
             the API is open to anyone who can reach it"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_port_in_use_names_server_port_and_where_it_is_set() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let err = listen(addr, |field| format!("origin of {field}")).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "server.port {} (origin of server.port): cannot listen on {addr}: address \
                 already in use",
                addr.port()
            )
        );
        // A free port is bound, and listens.
        let free = listen("127.0.0.1:0".parse().unwrap(), |_| unreachable!()).unwrap();
        std::net::TcpStream::connect(free.local_addr().unwrap()).unwrap();
    }

    #[test]
    fn an_address_not_assignable_here_names_server_host() {
        // TEST-NET-1 (RFC 5737) is never a local address.
        let addr: SocketAddr = "192.0.2.1:8000".parse().unwrap();
        let err = listen(addr, |field| format!("origin of {field}")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "server.host 192.0.2.1 (origin of server.host): cannot listen on 192.0.2.1:8000: \
             cannot assign requested address"
        );
    }

    #[test]
    fn a_load_format_must_match_what_the_path_holds() {
        let dir = crate::scratch::ScratchDir::new("serve-format");
        let gguf = dir.join("m.gguf");
        std::fs::write(&gguf, b"GGUF").unwrap();
        assert!(load_format(LoadFormat::Gguf, &gguf).is_ok());
        assert!(load_format(LoadFormat::Auto, &gguf).is_ok());
        let e = load_format(LoadFormat::Safetensors, &gguf)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("model.load_format is safetensors") && e.contains("gguf"),
            "{e}"
        );
        std::fs::write(dir.join("config.json"), b"{}").unwrap();
        assert!(load_format(LoadFormat::Safetensors, &dir).is_ok());
        let e = load_format(LoadFormat::Gguf, &dir).unwrap_err().to_string();
        assert!(e.contains("holds a safetensors model"), "{e}");
        // A missing path is the loader's to report.
        assert!(load_format(LoadFormat::Gguf, &dir.join("missing")).is_ok());
    }

    #[test]
    fn max_model_len_must_fit_in_the_kv_cache() {
        // It fits: unchanged, configured or not.
        assert_eq!(
            fit_kv_cache(8192, true, (512, 16), 8192, None).unwrap(),
            8192
        );
        assert_eq!(
            fit_kv_cache(8192, false, (600, 16), 8192, None).unwrap(),
            8192
        );
        // The model's own context is lowered to what the cache holds.
        assert_eq!(
            fit_kv_cache(8192, false, (45, 16), 8192, None).unwrap(),
            720
        );
        // Under a sliding window, a cache that holds what a sequence holds at once fits
        // every length (500 + 16 + 4 behind and a chunk of 152 are 42 blocks, 45 with the
        // partial ones); a smaller one is what it was (a chunk of 153 takes 46).
        let w = Some(switchyard_policies::SlidingWindow {
            tokens: 500,
            read_slack: 16,
        });
        assert_eq!(fit_kv_cache(8192, true, (45, 16), 152, w).unwrap(), 8192);
        assert_eq!(fit_kv_cache(8192, false, (45, 16), 153, w).unwrap(), 720);
        // A configured one is refused, with both numbers and what to change.
        let e = fit_kv_cache(8192, true, (45, 16), 8192, None)
            .unwrap_err()
            .to_string();
        for part in [
            "model.max_model_len is 8192",
            "720 tokens",
            "45 blocks of 16",
            "cache.kv_cache_mb",
            "cache.gpu_memory_utilization",
            "at most 720",
        ] {
            assert!(e.contains(part), "`{part}` missing: {e}");
        }
    }

    #[test]
    fn max_model_len_may_not_exceed_the_context() {
        let p = Path::new("/m.gguf");
        assert_eq!(max_model_len(None, 8192, p).unwrap(), 8192);
        assert_eq!(max_model_len(Some(2048), 8192, p).unwrap(), 2048);
        assert_eq!(max_model_len(Some(8192), 8192, p).unwrap(), 8192);
        let e = max_model_len(Some(8193), 8192, p).unwrap_err().to_string();
        assert!(
            e.contains("model.max_model_len is 8193") && e.contains("8192 tokens"),
            "{e}"
        );
    }
}
