//! Limits derived from what is real: every count and size a user or a file supplies is checked
//! against the machine (its cores and memory) and the engine's own bounds before anything is
//! allocated from it, and text files are read only when they are regular files of a bounded size.
//! Each error names the value and the limit it broke; the command line adds the flag.

use std::io::Read;
use std::path::{Path, PathBuf};

/// The longest context the engine takes (positions are 32-bit, and the block tables and
/// scheduler bookkeeping of a longer one would dwarf a small model).
pub const MAX_N_CTX: usize = 1 << 24;

/// The largest text file read as a whole: a prompt or a perplexity corpus (wikitext-2's test
/// split is 1.3 MB). Tokenizing takes several times the text's size in memory.
pub const MAX_TEXT_FILE_BYTES: u64 = 64 << 20;

/// The largest chat template read from a file (real templates are a few kilobytes; the largest
/// known, with tool-use instructions, under 100 KB). The same cap applies to a model's own
/// template (`ember_tokenizer::MAX_TEMPLATE_BYTES`).
pub const MAX_TEMPLATE_FILE_BYTES: u64 = ember_tokenizer::MAX_TEMPLATE_BYTES as u64;

/// A value over its limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    /// More threads than the machine can run at once.
    #[error("{threads} threads: expected at most the {available} this machine runs at once")]
    Threads { threads: usize, available: usize },
    /// A context longer than the engine takes.
    #[error("a context of {n_ctx} tokens: expected at most {max}")]
    ContextTooLong { n_ctx: usize, max: usize },
    /// A KV cache that does not fit in memory.
    #[error("{tokens} tokens of KV cache need {needed} bytes ({} GiB, {kv_bytes_per_token} bytes a token): expected at most the {available} bytes ({} GiB) of {place}", gib(*needed), gib(*available))]
    KvTooLarge {
        tokens: usize,
        kv_bytes_per_token: usize,
        needed: u128,
        available: u128,
        /// Whose memory: `memory available` (this process's) or a device's free memory.
        place: String,
    },
    /// A count that must be positive is 0.
    #[error("0: expected at least 1")]
    Zero,
}

fn gib(bytes: u128) -> String {
    format!("{:.1}", bytes as f64 / (1u64 << 30) as f64)
}

/// Checks a worker thread count (0 meaning "the default") against the available parallelism.
pub fn check_threads(threads: usize) -> Result<(), LimitError> {
    let available = std::thread::available_parallelism().map_or(1, |n| n.get());
    if threads > available {
        return Err(LimitError::Threads { threads, available });
    }
    Ok(())
}

/// The memory the system can give this process now (Linux's `MemAvailable`), capped by the
/// process's address-space limit; `None` where neither is known.
pub fn available_memory() -> Option<u64> {
    let from_meminfo = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines().find_map(|line| {
                let rest = line.strip_prefix("MemAvailable:")?;
                let kib: u64 = rest.trim().strip_suffix("kB")?.trim().parse().ok()?;
                kib.checked_mul(1024)
            })
        });
    let from_rlimit = address_space_limit();
    match (from_meminfo, from_rlimit) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

#[cfg(unix)]
fn address_space_limit() -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` through a valid pointer.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut limit) } == 0;
    // `rlim_t` is 64 bits on Linux, but not on every Unix.
    #[allow(clippy::unnecessary_cast)]
    let current = limit.rlim_cur as u64;
    (ok && limit.rlim_cur != libc::RLIM_INFINITY).then_some(current)
}

#[cfg(not(unix))]
fn address_space_limit() -> Option<u64> {
    None
}

/// Memory a KV cache may take, and whose it is (for the error).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvMemory {
    pub bytes: u64,
    /// Says whose memory, after "of": `memory available`, or a device's free memory.
    pub place: String,
}

impl KvMemory {
    /// This process's memory, for a model on the CPU ([`available_memory`]).
    pub fn host() -> Option<KvMemory> {
        available_memory().map(|bytes| KvMemory {
            bytes,
            place: "memory available".into(),
        })
    }

    /// A device's, for a model on a GPU: its free memory plus what its pool holds idle, within
    /// the VRAM budget ([`ember_gpu::DevicePool::available_bytes`]).
    pub fn device(pool: &ember_gpu::DevicePool) -> Option<KvMemory> {
        let budget = match pool.config().budget {
            Some(budget) => format!(" within the --vram-budget of {budget} bytes"),
            None => String::new(),
        };
        pool.available_bytes().map(|bytes| KvMemory {
            bytes,
            place: format!("memory free on GPU {}{budget}", pool.device()),
        })
    }

    /// The memory of where a model runs: the device of its pool, else this process's.
    pub fn of(pool: Option<&ember_gpu::DevicePool>) -> Option<KvMemory> {
        match pool {
            Some(pool) => KvMemory::device(pool),
            None => KvMemory::host(),
        }
    }
}

/// Checks a context of `n_ctx` tokens for each of `sequences` sequences: against
/// [`MAX_N_CTX`], and their KV cache (`kv_bytes_per_token` a token) against `memory` when known
/// ([`KvMemory::of`] the model's pool).
pub fn check_context(
    n_ctx: usize,
    sequences: usize,
    kv_bytes_per_token: usize,
    memory: Option<&KvMemory>,
) -> Result<(), LimitError> {
    if n_ctx > MAX_N_CTX {
        return Err(LimitError::ContextTooLong {
            n_ctx,
            max: MAX_N_CTX,
        });
    }
    let tokens = n_ctx.saturating_mul(sequences);
    check_kv_tokens(tokens, kv_bytes_per_token, memory)
}

/// Checks a KV cache of `tokens` tokens in all against `memory`, when known.
pub fn check_kv_tokens(
    tokens: usize,
    kv_bytes_per_token: usize,
    memory: Option<&KvMemory>,
) -> Result<(), LimitError> {
    let needed = tokens as u128 * kv_bytes_per_token as u128;
    match memory {
        Some(memory) if needed > memory.bytes as u128 => Err(LimitError::KvTooLarge {
            tokens,
            kv_bytes_per_token,
            needed,
            available: memory.bytes as u128,
            place: memory.place.clone(),
        }),
        _ => Ok(()),
    }
}

/// Checks a count that must be at least 1.
pub fn check_positive(value: usize) -> Result<(), LimitError> {
    if value == 0 {
        return Err(LimitError::Zero);
    }
    Ok(())
}

/// Why a text file was not read.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("cannot read {}: {source}", .path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: expected a regular file, found {kind}", .path.display())]
    NotRegular { path: PathBuf, kind: &'static str },
    #[error("{} is {size} bytes: expected at most {max}", .path.display())]
    TooLarge { path: PathBuf, size: u64, max: u64 },
    #[error("{}: expected UTF-8 text", .path.display())]
    NotUtf8 { path: PathBuf },
}

fn kind_of(file_type: std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if file_type.is_fifo() {
            return "a FIFO";
        }
        if file_type.is_char_device() {
            return "a character device";
        }
        if file_type.is_block_device() {
            return "a block device";
        }
        if file_type.is_socket() {
            return "a socket";
        }
    }
    if file_type.is_dir() {
        "a directory"
    } else {
        "something other than a file"
    }
}

/// Reads a whole UTF-8 text file of at most `max` bytes. Only a regular file is read (a FIFO,
/// a device such as `/dev/zero` or a directory is refused without reading, and opening never
/// blocks), and never more than `max + 1` bytes of it, even when it grows while being read.
pub fn read_text_file(path: &Path, max: u64) -> Result<String, FileError> {
    let io = |source| FileError::Io {
        path: path.to_path_buf(),
        source,
    };
    let metadata = std::fs::metadata(path).map_err(io)?;
    if !metadata.is_file() {
        return Err(FileError::NotRegular {
            path: path.to_path_buf(),
            kind: kind_of(metadata.file_type()),
        });
    }
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        // Should the path have become a FIFO since, opening it does not wait for a writer.
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options.open(path).map_err(io)?;
    let metadata = file.metadata().map_err(io)?;
    if !metadata.is_file() {
        return Err(FileError::NotRegular {
            path: path.to_path_buf(),
            kind: kind_of(metadata.file_type()),
        });
    }
    let too_large = |size| FileError::TooLarge {
        path: path.to_path_buf(),
        size,
        max,
    };
    if metadata.len() > max {
        return Err(too_large(metadata.len()));
    }
    let mut bytes = Vec::with_capacity(metadata.len() as usize);
    file.take(max + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > max {
        return Err(too_large(bytes.len() as u64));
    }
    String::from_utf8(bytes).map_err(|_| FileError::NotUtf8 {
        path: path.to_path_buf(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_files_are_regular_and_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.txt");
        std::fs::write(&path, "hello").unwrap();
        assert_eq!(read_text_file(&path, 5).unwrap(), "hello");
        let error = read_text_file(&path, 4).unwrap_err();
        assert!(
            matches!(
                error,
                FileError::TooLarge {
                    size: 5,
                    max: 4,
                    ..
                }
            ),
            "{error}"
        );
        let error = read_text_file(dir.path(), 100).unwrap_err();
        assert!(error.to_string().contains("a directory"), "{error}");
        #[cfg(unix)]
        {
            let error = read_text_file(Path::new("/dev/zero"), 100).unwrap_err();
            assert!(error.to_string().contains("a character device"), "{error}");
            let fifo = dir.path().join("fifo");
            let c_path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
            // SAFETY: mkfifo reads a NUL-terminated path.
            assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
            let error = read_text_file(&fifo, 100).unwrap_err();
            assert!(error.to_string().contains("a FIFO"), "{error}");
        }
        std::fs::write(&path, [0xff, 0xfe]).unwrap();
        assert!(matches!(
            read_text_file(&path, 10),
            Err(FileError::NotUtf8 { .. })
        ));
    }

    /// On a GPU the KV cache is checked against the device's free memory (the host driver
    /// pretending to be a device of 256 MiB), and the error names the bytes and the device.
    #[test]
    fn contexts_on_a_device_are_checked_against_its_free_memory() {
        use ember_gpu::host::{HostDriver, HostDriverConfig};
        use ember_gpu::{DevicePool, PoolConfig, PoolKind, Purpose};
        const MIB: u64 = 1 << 20;
        let driver = std::sync::Arc::new(HostDriver::new(HostDriverConfig {
            total_memory: 256 * MIB,
            ..HostDriverConfig::default()
        }));
        let pool = DevicePool::with_kind(
            driver,
            0,
            PoolKind::Caching,
            "test".into(),
            PoolConfig::default(),
        )
        .unwrap();
        let _weights = pool.alloc(Purpose::Weights, 192 * MIB).unwrap();
        let memory = KvMemory::of(Some(&pool)).unwrap();
        assert_eq!(memory.bytes, 64 * MIB);
        // 32768 tokens of 1 KiB fit in 64 MiB; 65536 do not.
        assert_eq!(check_context(32768, 2, 1024, Some(&memory)), Ok(()));
        let error = check_context(65537, 1, 1024, Some(&memory)).unwrap_err();
        assert_eq!(
            error.to_string(),
            "65537 tokens of KV cache need 67109888 bytes (0.1 GiB, 1024 bytes a token): \
             expected at most the 67108864 bytes (0.1 GiB) of memory free on GPU 0"
        );

        // With a budget, its room is the limit, and the error says so.
        let driver = std::sync::Arc::new(HostDriver::new(HostDriverConfig {
            total_memory: 256 * MIB,
            ..HostDriverConfig::default()
        }));
        let budget = PoolConfig {
            budget: Some(200 * MIB),
            ..PoolConfig::default()
        };
        let pool =
            DevicePool::with_kind(driver, 0, PoolKind::Caching, "test".into(), budget).unwrap();
        let _weights = pool.alloc(Purpose::Weights, 192 * MIB).unwrap();
        let memory = KvMemory::of(Some(&pool)).unwrap();
        assert_eq!(memory.bytes, 8 * MIB);
        let error = check_context(16384, 1, 1024, Some(&memory)).unwrap_err();
        assert!(
            error
                .to_string()
                .ends_with("of memory free on GPU 0 within the --vram-budget of 209715200 bytes"),
            "{error}"
        );
    }

    #[test]
    fn contexts_are_checked_against_the_engine_and_memory() {
        let gib = |n: u64| KvMemory {
            bytes: n << 30,
            place: "memory available".into(),
        };
        assert_eq!(check_context(4096, 4, 1000, Some(&gib(1))), Ok(()));
        assert!(matches!(
            check_context(MAX_N_CTX + 1, 1, 1, None),
            Err(LimitError::ContextTooLong { .. })
        ));
        let error = check_context(1 << 20, 1, 1 << 12, Some(&gib(1))).unwrap_err();
        assert!(matches!(error, LimitError::KvTooLarge { .. }));
        assert!(
            error.to_string().contains("need 4294967296 bytes (4.0 GiB"),
            "{error}"
        );
        assert!(
            error
                .to_string()
                .ends_with("at most the 1073741824 bytes (1.0 GiB) of memory available"),
            "{error}"
        );
        // Products that overflow usize are still refused, not wrapped.
        let all = KvMemory {
            bytes: u64::MAX,
            place: "memory available".into(),
        };
        assert!(check_context(MAX_N_CTX, usize::MAX, 2, Some(&all)).is_err());
        assert_eq!(check_threads(0), Ok(()));
        assert!(check_threads(usize::MAX).is_err());
        assert_eq!(check_positive(0), Err(LimitError::Zero));
    }
}
