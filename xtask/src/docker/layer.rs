//! The image's one file layer: everything `docker/Dockerfile` adds to the base image, prepared by
//! xtask as one tar that the Dockerfile `ADD`s at `/`, so two builds of one commit give the same
//! layer digest.
//!
//! Why not `RUN useradd ...` as before: the classic `docker build` (no BuildKit here, so no
//! `rewrite-timestamp`) commits what a step changed with the times it ran at: file and directory
//! mtimes, and the day of the password's last change in `/etc/shadow`. ADD of a local tar, by
//! experiment on dockerd 20.10, keeps each entry's mode, owner and mtime, and sets a directory's
//! mtime after extracting into it; so a tar whose entries are sorted, dated `SOURCE_DATE_EPOCH`,
//! with fixed owners and modes and an entry for every parent directory gives a byte-identical
//! layer on every `--no-cache` build.
//!
//! The layer holds:
//! - the artifact unpacked under `/opt/ember-dist/` (checked against its `SHA256SUMS` here, before
//!   packing: the image has no step left that could check it) and the link `/opt/ember` to it;
//! - the entrypoint and health-check scripts in `/usr/local/bin/`;
//! - the `ember` user (uid and gid 10001, no login) and its group, appended to the base image's own
//!   `/etc/passwd`, `/etc/group`, `/etc/shadow`, `/etc/gshadow`, `/etc/subuid` and `/etc/subgid`
//!   (those it has), which keep the base's owners and modes; `ember` is a member of `video` and
//!   `render` where the base has those groups (they own `/dev/kfd` and `/dev/dri` on ROCm hosts);
//! - its home `/var/lib/ember` with the base's `/etc/skel`, and `/models`, both owned by it;
//! - every parent directory, with the base's owner and mode where the base has it.
//!
//! These are what `useradd --no-log-init --uid 10001 --user-group --create-home --home-dir
//! /var/lib/ember --shell /usr/sbin/nologin ember` and `usermod --append --groups` wrote, with the
//! base's `/etc/login.defs` deciding the same fields (home mode, password ageing, the subordinate
//! id ranges it adds to `/etc/subuid` and `/etc/subgid` where the base has them). Not written:
//! useradd's backup files (`/etc/passwd-` ...).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};

use anyhow::{bail, ensure, Context, Result};

/// The unprivileged user the image runs as; its uid is also its group's gid.
pub const USER: &str = "ember";
pub const UID: u64 = 10001;
/// Paths inside the image, without the leading `/` (tar entry names).
pub const HOME: &str = "var/lib/ember";
pub const MODELS: &str = "models";
pub const DIST: &str = "opt/ember-dist";
pub const LINK: &str = "opt/ember";
pub const ENTRYPOINT: &str = "usr/local/bin/ember-entrypoint";
pub const HEALTHCHECK: &str = "usr/local/bin/ember-healthcheck";
const SHELL: &str = "/usr/sbin/nologin";
/// The groups that own the GPU device nodes on ROCm hosts.
const GPU_GROUPS: [&str; 2] = ["video", "render"];

/// What the layer reads from the base image. The directories are every parent of a layer entry
/// (a unit test checks that the list covers them), so the layer can give each the base's owner
/// and mode.
pub const BASE_FILES: [&str; 7] = [
    "etc/passwd",
    "etc/group",
    "etc/shadow",
    "etc/gshadow",
    "etc/subuid",
    "etc/subgid",
    "etc/login.defs",
];
pub const BASE_DIRS: [&str; 7] = [
    "etc",
    "opt",
    "usr",
    "usr/local",
    "usr/local/bin",
    "var",
    "var/lib",
];
/// Read with everything under it.
pub const BASE_SKEL: &str = "etc/skel";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Contents {
    Directory,
    File(Vec<u8>),
    Symlink(String),
}

/// One tar entry: what it is, its permission bits and its numeric owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub contents: Contents,
    pub mode: u32,
    pub uid: u64,
    pub gid: u64,
}

impl Entry {
    pub fn directory(mode: u32, uid: u64, gid: u64) -> Entry {
        Entry {
            contents: Contents::Directory,
            mode,
            uid,
            gid,
        }
    }

    pub fn file(bytes: Vec<u8>, mode: u32, uid: u64, gid: u64) -> Entry {
        Entry {
            contents: Contents::File(bytes),
            mode,
            uid,
            gid,
        }
    }

    /// A symlink owned by root; its mode is not used by Linux.
    pub fn symlink(target: &str) -> Entry {
        Entry {
            contents: Contents::Symlink(target.to_string()),
            mode: 0o777,
            uid: 0,
            gid: 0,
        }
    }
}

/// The mode and owner of a parent directory the layer has no entry for and the base lacks: what
/// `mkdir -p` as root under umask 022 makes.
const DEFAULT_PARENT: (u32, u64, u64) = (0o755, 0, 0);

/// A set of tar entries keyed by path (relative, no `.` or `..`, no trailing `/`).
#[derive(Debug, Default)]
pub struct Layer {
    entries: BTreeMap<String, Entry>,
}

impl Layer {
    /// Adds one entry; a path given twice is an error (two steps disagreeing about one file).
    pub fn insert(&mut self, path: &str, entry: Entry) -> Result<()> {
        check_path(path)?;
        ensure!(
            !self.entries.contains_key(path),
            "the image layer got two entries for {path}"
        );
        self.entries.insert(path.to_string(), entry);
        Ok(())
    }

    #[cfg(test)]
    fn get(&self, path: &str) -> Option<&Entry> {
        self.entries.get(path)
    }

    /// The parent directories that have no entry of their own, sorted.
    pub fn parents_without_entries(&self) -> Vec<String> {
        let mut parents = BTreeSet::new();
        for path in self.entries.keys() {
            let mut rest = path.as_str();
            while let Some((parent, _)) = rest.rsplit_once('/') {
                if !self.entries.contains_key(parent) {
                    parents.insert(parent.to_string());
                }
                rest = parent;
            }
        }
        parents.into_iter().collect()
    }

    /// Gives each parent directory without an entry the base's owner and mode, where the base has
    /// it; a parent that the base has as something other than a directory is an error (extracting
    /// the layer would replace it).
    pub fn inherit_parents(&mut self, base: &BaseFiles) -> Result<()> {
        for parent in self.parents_without_entries() {
            match base.entries.get(&parent) {
                Some(entry) if entry.contents == Contents::Directory => {
                    self.entries.insert(parent, entry.clone());
                }
                Some(_) => bail!(
                    "expected /{parent} in the base image to be a directory, found another kind of file: the image puts files under it"
                ),
                None => {}
            }
        }
        Ok(())
    }

    /// Writes the layer as an uncompressed tar: every entry dated `mtime`, sorted by path, with
    /// an entry for every parent directory (those without one get [`DEFAULT_PARENT`]), numeric
    /// owners and no user or group names, so the bytes depend on nothing but the entries.
    pub fn write(&self, out: impl Write, mtime: u64) -> Result<()> {
        let mut all = self.entries.clone();
        for parent in self.parents_without_entries() {
            let (mode, uid, gid) = DEFAULT_PARENT;
            all.insert(parent, Entry::directory(mode, uid, gid));
        }
        let mut builder = tar::Builder::new(out);
        for (path, entry) in &all {
            let mut header = tar::Header::new_gnu();
            header.set_mode(entry.mode);
            header.set_uid(entry.uid);
            header.set_gid(entry.gid);
            header.set_mtime(mtime);
            match &entry.contents {
                Contents::Directory => {
                    header.set_entry_type(tar::EntryType::Directory);
                    header.set_size(0);
                    builder.append_data(&mut header, format!("{path}/"), std::io::empty())?;
                }
                Contents::File(bytes) => {
                    header.set_entry_type(tar::EntryType::Regular);
                    header.set_size(bytes.len() as u64);
                    builder.append_data(&mut header, path, bytes.as_slice())?;
                }
                Contents::Symlink(target) => {
                    header.set_entry_type(tar::EntryType::Symlink);
                    header.set_size(0);
                    builder.append_link(&mut header, path, target)?;
                }
            }
        }
        builder.into_inner()?.flush()?;
        Ok(())
    }
}

fn check_path(path: &str) -> Result<()> {
    ensure!(
        !path.is_empty()
            && !path.starts_with('/')
            && !path.ends_with('/')
            && path
                .split('/')
                .all(|part| !part.is_empty() && part != "." && part != ".."),
        "expected a relative path without `.`, `..` or empty parts in the image layer, found {path:?}"
    );
    Ok(())
}

/// Reads a tar entry's path as a layer path: UTF-8, leading `/` or `./` and trailing `/` dropped.
fn entry_path(entry: &tar::Entry<impl Read>) -> Result<String> {
    let raw = entry.path_bytes();
    let text = std::str::from_utf8(&raw).with_context(|| {
        format!(
            "expected a UTF-8 path, found {:?}",
            String::from_utf8_lossy(&raw)
        )
    })?;
    let trimmed = text.trim_start_matches("./").trim_start_matches('/');
    let trimmed = trimmed.trim_end_matches('/');
    check_path(trimmed)?;
    Ok(trimmed.to_string())
}

// ---------------------------------------------------------------------------------------------
// The base image's files.

/// Files and directories read from the base image, keyed by path without the leading `/`.
#[derive(Debug, Default)]
pub struct BaseFiles {
    entries: BTreeMap<String, Entry>,
}

impl BaseFiles {
    /// Reads the tar that `tar --create` in the base image wrote ([`super::read_base_files`]).
    pub fn from_tar(bytes: &[u8]) -> Result<BaseFiles> {
        let mut entries = BTreeMap::new();
        let mut archive = tar::Archive::new(bytes);
        for entry in archive.entries()? {
            let mut entry = entry?;
            let path = entry_path(&entry)?;
            let header = entry.header();
            let (mode, uid, gid) = (header.mode()?, header.uid()?, header.gid()?);
            let contents = match header.entry_type() {
                tar::EntryType::Directory => Contents::Directory,
                tar::EntryType::Regular | tar::EntryType::Continuous => {
                    let mut bytes = Vec::new();
                    entry.read_to_end(&mut bytes)?;
                    Contents::File(bytes)
                }
                tar::EntryType::Symlink => Contents::Symlink(
                    entry
                        .link_name()?
                        .with_context(|| format!("/{path}: a symlink without a target"))?
                        .to_string_lossy()
                        .into_owned(),
                ),
                other => bail!(
                    "/{path} in the base image: expected a file, directory or symlink, found tar entry type {other:?}"
                ),
            };
            entries.insert(
                path,
                Entry {
                    contents,
                    mode: mode & 0o7777,
                    uid,
                    gid,
                },
            );
        }
        Ok(BaseFiles { entries })
    }

    /// A regular file of the base: its bytes and entry, or None where the base lacks it.
    fn file(&self, path: &str) -> Result<Option<(&[u8], &Entry)>> {
        match self.entries.get(path) {
            None => Ok(None),
            Some(entry) => match &entry.contents {
                Contents::File(bytes) => Ok(Some((bytes, entry))),
                _ => bail!("expected /{path} in the base image to be a regular file, found another kind of file"),
            },
        }
    }

    fn text(&self, path: &str) -> Result<Option<(&str, &Entry)>> {
        match self.file(path)? {
            None => Ok(None),
            Some((bytes, entry)) => Ok(Some((
                std::str::from_utf8(bytes).with_context(|| {
                    format!("expected /{path} in the base image to be UTF-8 text")
                })?,
                entry,
            ))),
        }
    }
}

/// The fields of the base's `/etc/login.defs` that useradd reads for a new user.
#[derive(Debug, PartialEq, Eq)]
struct LoginDefs {
    home_mode: u32,
    pass_min_days: Option<i64>,
    pass_max_days: Option<i64>,
    pass_warn_age: Option<i64>,
    /// The uids of regular users (`UID_MIN`..=`UID_MAX`): only those get subordinate ids.
    uid_range: (u64, u64),
    /// (first, last, count) of a new user's subordinate uid and gid range.
    sub_uids: (u64, u64, u64),
    sub_gids: (u64, u64, u64),
}

impl LoginDefs {
    /// As shadow-utils reads them: `HOME_MODE`, else `0777 & !UMASK` (UMASK defaults to 022); an
    /// ageing field that is missing or -1 stays empty in `/etc/shadow`.
    fn parse(text: &str) -> Result<LoginDefs> {
        let mut values = BTreeMap::new();
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut parts = line.split_whitespace();
            if let (Some(key), Some(value)) = (parts.next(), parts.next()) {
                values.insert(key, value);
            }
        }
        let octal = |key: &str| -> Result<Option<u32>> {
            values
                .get(key)
                .map(|value| {
                    u32::from_str_radix(value, 8).with_context(|| {
                        format!("/etc/login.defs: expected an octal {key}, found {value:?}")
                    })
                })
                .transpose()
        };
        let days = |key: &str| -> Result<Option<i64>> {
            let value = values
                .get(key)
                .map(|value| {
                    value.parse::<i64>().with_context(|| {
                        format!(
                            "/etc/login.defs: expected a number of days for {key}, found {value:?}"
                        )
                    })
                })
                .transpose()?;
            Ok(value.filter(|days| *days >= 0))
        };
        let number = |key: &str, default: u64| -> Result<u64> {
            values.get(key).map_or(Ok(default), |value| {
                value.parse::<u64>().with_context(|| {
                    format!("/etc/login.defs: expected a number for {key}, found {value:?}")
                })
            })
        };
        let umask = octal("UMASK")?.unwrap_or(0o022);
        // shadow-utils' defaults for keys the file does not set.
        Ok(LoginDefs {
            home_mode: octal("HOME_MODE")?.unwrap_or(0o777 & !umask),
            pass_min_days: days("PASS_MIN_DAYS")?,
            pass_max_days: days("PASS_MAX_DAYS")?,
            pass_warn_age: days("PASS_WARN_AGE")?,
            uid_range: (number("UID_MIN", 1000)?, number("UID_MAX", 60000)?),
            sub_uids: (
                number("SUB_UID_MIN", 100_000)?,
                number("SUB_UID_MAX", 600_100_000)?,
                number("SUB_UID_COUNT", 65536)?,
            ),
            sub_gids: (
                number("SUB_GID_MIN", 100_000)?,
                number("SUB_GID_MAX", 600_100_000)?,
                number("SUB_GID_COUNT", 65536)?,
            ),
        })
    }
}

/// The first `count` ids from `first` on, ending by `last`, that no range of the subordinate id
/// file `text` (`name:start:count` lines) overlaps: the range useradd gives a new user.
fn free_subordinate_range(
    file: &str,
    text: &str,
    (first, last, count): (u64, u64, u64),
) -> Result<u64> {
    let mut ranges = Vec::new();
    for line in text.lines().filter(|line| !line.trim().is_empty()) {
        let fields: Vec<&str> = line.split(':').collect();
        let parsed = match fields.as_slice() {
            [_, start, count] => start.parse::<u64>().ok().zip(count.parse::<u64>().ok()),
            _ => None,
        };
        let (start, count) = parsed.with_context(|| {
            format!("the base image's {file}: expected `name:start:count` lines, found {line:?}")
        })?;
        ranges.push((start, start.saturating_add(count)));
    }
    ranges.sort_unstable();
    let mut candidate = first;
    for (start, end) in ranges {
        if end <= candidate {
            continue;
        }
        if start >= candidate.saturating_add(count) {
            break;
        }
        candidate = end;
    }
    ensure!(
        count > 0 && candidate.saturating_add(count - 1) <= last,
        "the base image's {file}: no free range of {count} ids between {first} and {last}"
    );
    Ok(candidate)
}

/// `text` with `line` appended as a line of its own.
fn append_line(text: &str, line: &str) -> String {
    let mut out = text.to_string();
    if !out.is_empty() && !out.ends_with('\n') {
        out.push('\n');
    }
    out.push_str(line);
    out.push('\n');
    out
}

/// Fails when a line of the colon-separated `text` (`/etc/passwd` or `/etc/group`) already has
/// `name` in field 0 or `id` in field 2.
fn check_free(file: &str, text: &str, name: &str, id: u64) -> Result<()> {
    for line in text.lines() {
        let fields: Vec<&str> = line.split(':').collect();
        if fields.first() == Some(&name) {
            bail!("the base image's {file} already has {name}: {line:?}; the image adds its own {name} with id {id}");
        }
        if fields.get(2) == Some(&id.to_string().as_str()) {
            bail!("the base image's {file} already uses id {id}: {line:?}; the image needs it for {name}");
        }
    }
    Ok(())
}

/// Adds `user` to the member list (field `members_field`) of each group of `groups` that `text`
/// has (`/etc/group`: field 3; `/etc/gshadow`: field 3 too), as `usermod --append --groups` does.
fn add_to_groups(text: &str, groups: &[&str], members_field: usize, user: &str) -> String {
    let mut out = String::with_capacity(text.len() + 32);
    for line in text.split_inclusive('\n') {
        let (body, newline) = match line.strip_suffix('\n') {
            Some(body) => (body, "\n"),
            None => (line, ""),
        };
        let mut fields: Vec<String> = body.split(':').map(str::to_string).collect();
        let is_target = fields
            .first()
            .is_some_and(|name| groups.contains(&name.as_str()));
        if is_target && fields.len() > members_field {
            let members = &mut fields[members_field];
            if !members.split(',').any(|member| member == user) {
                if !members.is_empty() {
                    members.push(',');
                }
                members.push_str(user);
            }
            out.push_str(&fields.join(":"));
        } else {
            out.push_str(body);
        }
        out.push_str(newline);
    }
    out
}

/// The account entries: the user and its group appended to the base's account files, with the
/// base's owners and modes; `epoch` dates the password's last change, as useradd dates it by the
/// day it runs.
fn add_accounts(layer: &mut Layer, base: &BaseFiles, epoch: u64) -> Result<LoginDefs> {
    let defs = match base.text("etc/login.defs")? {
        Some((text, _)) => LoginDefs::parse(text)?,
        None => LoginDefs::parse("")?,
    };
    let (passwd, passwd_entry) = base
        .text("etc/passwd")?
        .context("expected /etc/passwd in the base image, found none")?;
    let (group, group_entry) = base
        .text("etc/group")?
        .context("expected /etc/group in the base image, found none")?;
    check_free("/etc/passwd", passwd, USER, UID)?;
    check_free("/etc/group", group, USER, UID)?;
    let file = |bytes: String, like: &Entry| {
        Entry::file(bytes.into_bytes(), like.mode, like.uid, like.gid)
    };
    layer.insert(
        "etc/passwd",
        file(
            append_line(passwd, &format!("{USER}:x:{UID}:{UID}::/{HOME}:{SHELL}")),
            passwd_entry,
        ),
    )?;
    layer.insert(
        "etc/group",
        file(
            append_line(
                &add_to_groups(group, &GPU_GROUPS, 3, USER),
                &format!("{USER}:x:{UID}:"),
            ),
            group_entry,
        ),
    )?;
    if let Some((shadow, entry)) = base.text("etc/shadow")? {
        let day = epoch / 86_400;
        let age = |days: Option<i64>| days.map(|days| days.to_string()).unwrap_or_default();
        let line = format!(
            "{USER}:!:{day}:{}:{}:{}:::",
            age(defs.pass_min_days),
            age(defs.pass_max_days),
            age(defs.pass_warn_age)
        );
        layer.insert("etc/shadow", file(append_line(shadow, &line), entry))?;
    }
    let (uid_min, uid_max) = defs.uid_range;
    if (uid_min..=uid_max).contains(&UID) {
        for (path, range) in [("etc/subuid", defs.sub_uids), ("etc/subgid", defs.sub_gids)] {
            if let Some((text, entry)) = base.text(path)? {
                let start = free_subordinate_range(&format!("/{path}"), text, range)?;
                let line = format!("{USER}:{start}:{}", range.2);
                layer.insert(path, file(append_line(text, &line), entry))?;
            }
        }
    }
    if let Some((gshadow, entry)) = base.text("etc/gshadow")? {
        layer.insert(
            "etc/gshadow",
            file(
                append_line(
                    &add_to_groups(gshadow, &GPU_GROUPS, 3, USER),
                    &format!("{USER}:!::"),
                ),
                entry,
            ),
        )?;
    }
    Ok(defs)
}

/// The home directory with the base's `/etc/skel` in it, owned by the user (as `useradd
/// --create-home` copies it), and `/models`.
fn add_home(layer: &mut Layer, base: &BaseFiles, defs: &LoginDefs) -> Result<()> {
    layer.insert(HOME, Entry::directory(defs.home_mode, UID, UID))?;
    let prefix = format!("{BASE_SKEL}/");
    for (path, entry) in &base.entries {
        let Some(name) = path.strip_prefix(&prefix) else {
            continue;
        };
        let mut owned = entry.clone();
        owned.uid = UID;
        owned.gid = UID;
        layer.insert(&format!("{HOME}/{name}"), owned)?;
    }
    layer.insert(MODELS, Entry::directory(0o755, UID, UID))?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The artifact.

/// The package's files from the artifact (`.tar.gz` bytes) whose folder is `stem`, checked against
/// its `SHA256SUMS` and for an executable `ember`: a corrupted or incomplete artifact fails here,
/// before any image is built. Keys are paths inside the package folder, starting with `stem`.
fn artifact_entries(archive: &[u8], stem: &str) -> Result<BTreeMap<String, Entry>> {
    let mut entries = BTreeMap::new();
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(archive));
    for entry in tar.entries().context("reading the artifact")? {
        let mut entry = entry.context("reading the artifact")?;
        let path = entry_path(&entry)?;
        ensure!(
            path == stem || path.starts_with(&format!("{stem}/")),
            "expected every entry of the artifact under {stem}/, found {path}"
        );
        let mode = entry.header().mode()? & 0o7777;
        let contents = match entry.header().entry_type() {
            tar::EntryType::Directory => Contents::Directory,
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                let mut bytes = Vec::new();
                entry
                    .read_to_end(&mut bytes)
                    .with_context(|| format!("reading {path} from the artifact"))?;
                Contents::File(bytes)
            }
            other => bail!("{path}: expected a file or directory in the artifact, found tar entry type {other:?}"),
        };
        entries.insert(
            path,
            Entry {
                contents,
                mode,
                uid: 0,
                gid: 0,
            },
        );
    }
    let sums = match entries.get(&format!("{stem}/SHA256SUMS")) {
        Some(Entry {
            contents: Contents::File(bytes),
            ..
        }) => String::from_utf8_lossy(bytes).into_owned(),
        _ => bail!("expected {stem}/SHA256SUMS in the artifact, found none"),
    };
    let digest_of = |path: &str| -> std::io::Result<String> {
        match entries.get(&format!("{stem}/{path}")) {
            Some(Entry {
                contents: Contents::File(bytes),
                ..
            }) => Ok(crate::package::sha256_hex(bytes)),
            _ => Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "not a file in the artifact",
            )),
        }
    };
    crate::smoke::check_sha256sums(&sums, digest_of).map_err(|problems| {
        anyhow::anyhow!("the artifact fails its SHA256SUMS: {}", problems.join("; "))
    })?;
    match entries.get(&format!("{stem}/ember")) {
        Some(Entry {
            contents: Contents::File(_),
            mode,
            ..
        }) if mode & 0o111 != 0 => {}
        _ => bail!(
            "expected an executable {stem}/ember next to SHA256SUMS in the artifact, found none"
        ),
    }
    Ok(entries)
}

/// What the layer is made of, besides the base's files.
pub struct Inputs<'a> {
    /// The packaged artifact, `.tar.gz` bytes.
    pub artifact: &'a [u8],
    /// Its folder name, `ember-<version>-linux-<target>-x64`.
    pub stem: &'a str,
    pub entrypoint: Vec<u8>,
    pub healthcheck: Vec<u8>,
    /// `SOURCE_DATE_EPOCH`: the day of the password's last change (the entries' mtime is given to
    /// [`Layer::write`]).
    pub epoch: u64,
}

/// The whole layer: artifact, link, scripts, accounts, home and `/models`, and the base's owner and
/// mode for every parent directory the base has.
pub fn image_layer(inputs: &Inputs, base: &BaseFiles) -> Result<Layer> {
    let mut layer = Layer::default();
    for (path, entry) in artifact_entries(inputs.artifact, inputs.stem)? {
        layer.insert(&format!("{DIST}/{path}"), entry)?;
    }
    layer.insert(DIST, Entry::directory(0o755, 0, 0))?;
    layer.insert(LINK, Entry::symlink(&format!("/{DIST}/{}", inputs.stem)))?;
    layer.insert(
        ENTRYPOINT,
        Entry::file(inputs.entrypoint.clone(), 0o755, 0, 0),
    )?;
    layer.insert(
        HEALTHCHECK,
        Entry::file(inputs.healthcheck.clone(), 0o755, 0, 0),
    )?;
    let defs = add_accounts(&mut layer, base, inputs.epoch)?;
    add_home(&mut layer, base, &defs)?;
    layer.inherit_parents(base)?;
    Ok(layer)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (path, type, mode, uid, gid, mtime, link or contents) of every entry, in order.
    fn listing(bytes: &[u8]) -> Vec<(String, char, u32, u64, u64, u64, String)> {
        let mut archive = tar::Archive::new(bytes);
        archive
            .entries()
            .unwrap()
            .map(|entry| {
                let mut entry = entry.unwrap();
                let header = entry.header().clone();
                let kind = match header.entry_type() {
                    tar::EntryType::Directory => 'd',
                    tar::EntryType::Regular => 'f',
                    tar::EntryType::Symlink => 'l',
                    other => panic!("unexpected {other:?}"),
                };
                assert_eq!(header.username().unwrap(), Some(""));
                assert_eq!(header.groupname().unwrap(), Some(""));
                let mut contents = String::new();
                entry.read_to_string(&mut contents).unwrap();
                let contents = match kind {
                    'l' => entry.link_name().unwrap().unwrap().to_string_lossy().into(),
                    _ => contents,
                };
                (
                    entry.path().unwrap().to_string_lossy().into_owned(),
                    kind,
                    header.mode().unwrap(),
                    header.uid().unwrap(),
                    header.gid().unwrap(),
                    header.mtime().unwrap(),
                    contents,
                )
            })
            .collect()
    }

    fn written(layer: &Layer, mtime: u64) -> Vec<u8> {
        let mut bytes = Vec::new();
        layer.write(&mut bytes, mtime).unwrap();
        bytes
    }

    #[test]
    fn the_writer_sorts_fixes_metadata_and_adds_every_parent() {
        let mut layer = Layer::default();
        // Inserted out of order; "a-b" sorts between "a" and "a/..." byte-wise.
        layer
            .insert(
                "var/lib/app/.profile",
                Entry::file(b"x\n".to_vec(), 0o644, 7, 8),
            )
            .unwrap();
        layer.insert("a-b", Entry::symlink("/a/c")).unwrap();
        layer
            .insert("var/lib/app", Entry::directory(0o750, 7, 8))
            .unwrap();
        layer
            .insert(
                "a/c/tool",
                Entry::file(b"#!/bin/sh\n".to_vec(), 0o755, 0, 0),
            )
            .unwrap();
        layer.insert("etc", Entry::directory(0o700, 0, 42)).unwrap();
        assert_eq!(
            layer.parents_without_entries(),
            vec!["a", "a/c", "var", "var/lib"]
        );
        let epoch = 1_796_020_765;
        let found = listing(&written(&layer, epoch));
        let row = |path: &str, kind, mode, uid, gid, contents: &str| {
            (
                path.to_string(),
                kind,
                mode,
                uid,
                gid,
                epoch,
                contents.to_string(),
            )
        };
        assert_eq!(
            found,
            vec![
                row("a/", 'd', 0o755, 0, 0, ""),
                row("a-b", 'l', 0o777, 0, 0, "/a/c"),
                row("a/c/", 'd', 0o755, 0, 0, ""),
                row("a/c/tool", 'f', 0o755, 0, 0, "#!/bin/sh\n"),
                row("etc/", 'd', 0o700, 0, 42, ""),
                row("var/", 'd', 0o755, 0, 0, ""),
                row("var/lib/", 'd', 0o755, 0, 0, ""),
                row("var/lib/app/", 'd', 0o750, 7, 8, ""),
                row("var/lib/app/.profile", 'f', 0o644, 7, 8, "x\n"),
            ]
        );
        // Nothing but the entries and the time decides the bytes.
        assert_eq!(written(&layer, epoch), written(&layer, epoch));
        assert_ne!(written(&layer, epoch), written(&layer, epoch + 1));
    }

    #[test]
    fn bad_and_repeated_paths_are_errors() {
        let mut layer = Layer::default();
        for bad in ["", "/etc", "etc/", "a//b", "a/../b", "./a"] {
            let error = layer
                .insert(bad, Entry::directory(0o755, 0, 0))
                .unwrap_err()
                .to_string();
            assert!(
                error.starts_with("expected a relative path"),
                "{bad}: {error}"
            );
        }
        layer.insert("etc", Entry::directory(0o755, 0, 0)).unwrap();
        assert_eq!(
            layer
                .insert("etc", Entry::directory(0o755, 0, 0))
                .unwrap_err()
                .to_string(),
            "the image layer got two entries for etc"
        );
    }

    #[test]
    fn parents_take_the_base_metadata_and_refuse_to_replace_a_non_directory() {
        let mut layer = Layer::default();
        layer
            .insert("opt/x/y", Entry::file(vec![], 0o644, 0, 0))
            .unwrap();
        let mut base = BaseFiles::default();
        base.entries
            .insert("opt".into(), Entry::directory(0o711, 0, 3));
        layer.inherit_parents(&base).unwrap();
        assert_eq!(layer.get("opt"), Some(&Entry::directory(0o711, 0, 3)));
        assert_eq!(layer.get("opt/x"), None);
        base.entries
            .insert("opt/x".into(), Entry::symlink("/elsewhere"));
        assert_eq!(
            layer.inherit_parents(&base).unwrap_err().to_string(),
            "expected /opt/x in the base image to be a directory, found another kind of file: the image puts files under it"
        );
    }

    #[test]
    fn group_membership_is_appended_once() {
        let group = "root:x:0:\nvideo:x:44:\nrender:x:105:alice\nplugdev:x:46:\n";
        assert_eq!(
            add_to_groups(group, &GPU_GROUPS, 3, "ember"),
            "root:x:0:\nvideo:x:44:ember\nrender:x:105:alice,ember\nplugdev:x:46:\n"
        );
        let twice = add_to_groups(
            &add_to_groups(group, &GPU_GROUPS, 3, "ember"),
            &GPU_GROUPS,
            3,
            "ember",
        );
        assert_eq!(twice, add_to_groups(group, &GPU_GROUPS, 3, "ember"));
        assert_eq!(append_line("a:x:1:", "b:x:2:"), "a:x:1:\nb:x:2:\n");
        assert_eq!(append_line("", "b:x:2:"), "b:x:2:\n");
    }

    #[test]
    fn subordinate_ranges_are_the_first_free_ones() {
        let check = |text: &str, range| free_subordinate_range("/etc/subuid", text, range);
        let default = (100_000, 600_100_000, 65536);
        assert_eq!(check("", default).unwrap(), 100_000);
        assert_eq!(check("alice:100000:65536\n", default).unwrap(), 165_536);
        // A gap big enough between two ranges is taken; one too small is skipped.
        let text = "b:300000:65536\na:100000:65536\nc:165536:100\n";
        assert_eq!(check(text, default).unwrap(), 165_636);
        assert_eq!(
            check(text, (100_000, 600_100_000, 200_000)).unwrap(),
            365_536
        );
        assert_eq!(check("a:1:1\n", default).unwrap(), 100_000);
        assert_eq!(
            check("a:100000:65536\n", (100_000, 165_535, 65536))
                .unwrap_err()
                .to_string(),
            "the base image's /etc/subuid: no free range of 65536 ids between 100000 and 165535"
        );
        assert_eq!(
            check("a:100000\n", default).unwrap_err().to_string(),
            "the base image's /etc/subuid: expected `name:start:count` lines, found \"a:100000\""
        );
    }

    #[test]
    fn login_defs_decide_home_mode_and_ageing() {
        let debian =
            "# comment\nUMASK\t\t022\nPASS_MAX_DAYS\t99999\nPASS_MIN_DAYS\t0\nPASS_WARN_AGE\t7\n";
        assert_eq!(
            LoginDefs::parse(debian).unwrap(),
            LoginDefs {
                home_mode: 0o755,
                pass_min_days: Some(0),
                pass_max_days: Some(99999),
                pass_warn_age: Some(7),
                uid_range: (1000, 60000),
                sub_uids: (100_000, 600_100_000, 65536),
                sub_gids: (100_000, 600_100_000, 65536),
            }
        );
        let ubuntu = format!("{debian}HOME_MODE\t0750\n");
        assert_eq!(
            LoginDefs::parse(&format!("{debian}SUB_UID_COUNT 1000\nUID_MAX 9999\n"))
                .unwrap()
                .sub_uids,
            (100_000, 600_100_000, 1000)
        );
        assert_eq!(LoginDefs::parse(&ubuntu).unwrap().home_mode, 0o750);
        let empty = LoginDefs::parse("PASS_MAX_DAYS -1\n").unwrap();
        assert_eq!((empty.home_mode, empty.pass_max_days), (0o755, None));
        assert_eq!(
            LoginDefs::parse("UMASK 9x\n").unwrap_err().to_string(),
            "/etc/login.defs: expected an octal UMASK, found \"9x\""
        );
    }

    // -----------------------------------------------------------------------------------------
    // The whole layer from a synthetic artifact and base.

    const STEM: &str = "ember-0.1.0-linux-cpu-x64";

    /// A `.tar.gz` artifact with an executable `ember`, a README and a SHA256SUMS over both;
    /// `corrupt` changes the binary after the sums were taken.
    fn artifact(corrupt: bool) -> Vec<u8> {
        let binary = b"\x7fELF engine".to_vec();
        let readme = b"readme\n".to_vec();
        let sums = crate::package::sha256sums(&[
            ("README.md".into(), crate::package::sha256_hex(&readme)),
            ("ember".into(), crate::package::sha256_hex(&binary)),
        ]);
        let binary = if corrupt {
            b"\x7fELF engin3".to_vec()
        } else {
            binary
        };
        let mut layer = Layer::default();
        layer.insert(STEM, Entry::directory(0o755, 0, 0)).unwrap();
        for (name, bytes, mode) in [
            ("ember", binary, 0o755),
            ("README.md", readme, 0o644),
            ("SHA256SUMS", sums.into_bytes(), 0o644),
        ] {
            layer
                .insert(
                    &format!("{STEM}/{name}"),
                    Entry::file(bytes, mode, 1000, 1000),
                )
                .unwrap();
        }
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        layer.write(&mut encoder, 1).unwrap();
        encoder.finish().unwrap()
    }

    /// A Debian-like base: account files with their real owners and modes, login.defs, a skel
    /// and the parent directories, written as `tar --create` in the base writes them.
    fn base() -> BaseFiles {
        let mut layer = Layer::default();
        let text = |s: &str| s.as_bytes().to_vec();
        let files = [
            (
                "etc/passwd",
                text("root:x:0:0:root:/root:/bin/bash\n"),
                0o644,
                0,
            ),
            (
                "etc/group",
                text("root:x:0:\nshadow:x:42:\nvideo:x:44:\n"),
                0o644,
                0,
            ),
            ("etc/shadow", text("root:*:20000:0:99999:7:::\n"), 0o640, 42),
            (
                "etc/gshadow",
                text("root:*::\nshadow:*::\nvideo:*::\n"),
                0o640,
                42,
            ),
            (
                "etc/login.defs",
                text("UMASK 022\nPASS_MAX_DAYS 99999\nPASS_MIN_DAYS 0\nPASS_WARN_AGE 7\n"),
                0o644,
                0,
            ),
            ("etc/skel/.profile", text("# profile\n"), 0o644, 0),
            ("etc/subuid", text(""), 0o644, 0),
            ("etc/subgid", text("alice:100000:65536\n"), 0o644, 0),
        ];
        for (path, bytes, mode, gid) in files {
            layer
                .insert(path, Entry::file(bytes, mode, 0, gid))
                .unwrap();
        }
        for dir in BASE_DIRS.iter().chain([&BASE_SKEL]) {
            layer.insert(dir, Entry::directory(0o755, 0, 0)).unwrap();
        }
        let mut bytes = Vec::new();
        layer.write(&mut bytes, 1_700_000_000).unwrap();
        BaseFiles::from_tar(&bytes).unwrap()
    }

    fn inputs(artifact: &[u8]) -> Inputs<'_> {
        Inputs {
            artifact,
            stem: STEM,
            entrypoint: b"#!/bin/sh\n".to_vec(),
            healthcheck: b"#!/bin/bash\n".to_vec(),
            epoch: 1_796_020_765,
        }
    }

    fn text_of(layer: &Layer, path: &str) -> String {
        match &layer.get(path).unwrap().contents {
            Contents::File(bytes) => String::from_utf8(bytes.clone()).unwrap(),
            other => panic!("{path}: {other:?}"),
        }
    }

    #[test]
    fn the_image_layer_holds_what_useradd_and_the_dockerfile_made() {
        let artifact = artifact(false);
        let layer = image_layer(&inputs(&artifact), &base()).unwrap();
        assert_eq!(
            text_of(&layer, "etc/passwd"),
            "root:x:0:0:root:/root:/bin/bash\nember:x:10001:10001::/var/lib/ember:/usr/sbin/nologin\n"
        );
        assert_eq!(
            text_of(&layer, "etc/group"),
            "root:x:0:\nshadow:x:42:\nvideo:x:44:ember\nember:x:10001:\n"
        );
        // 1_796_020_765 s is day 20787 since the epoch.
        assert_eq!(
            text_of(&layer, "etc/shadow"),
            "root:*:20000:0:99999:7:::\nember:!:20787:0:99999:7:::\n"
        );
        assert_eq!(
            text_of(&layer, "etc/gshadow"),
            "root:*::\nshadow:*::\nvideo:*::ember\nember:!::\n"
        );
        assert_eq!(text_of(&layer, "etc/subuid"), "ember:100000:65536\n");
        assert_eq!(
            text_of(&layer, "etc/subgid"),
            "alice:100000:65536\nember:165536:65536\n"
        );
        let shadow = layer.get("etc/shadow").unwrap();
        assert_eq!((shadow.mode, shadow.uid, shadow.gid), (0o640, 0, 42));
        assert_eq!(layer.get(HOME), Some(&Entry::directory(0o755, UID, UID)));
        assert_eq!(layer.get(MODELS), Some(&Entry::directory(0o755, UID, UID)));
        assert_eq!(
            layer.get("var/lib/ember/.profile"),
            Some(&Entry::file(b"# profile\n".to_vec(), 0o644, UID, UID))
        );
        assert_eq!(
            layer.get(LINK),
            Some(&Entry::symlink(&format!("/opt/ember-dist/{STEM}")))
        );
        // The artifact's files are root's, whoever owned them in the archive.
        let binary = layer.get(&format!("{DIST}/{STEM}/ember")).unwrap();
        assert_eq!((binary.mode, binary.uid, binary.gid), (0o755, 0, 0));
        assert_eq!(layer.get(ENTRYPOINT).unwrap().mode, 0o755);
        // Every parent has an entry taken from the base; none is left to the writer's default.
        assert_eq!(layer.parents_without_entries(), Vec::<String>::new());
        assert!(layer.get("etc/login.defs").is_none());
        assert!(layer.get("etc/skel").is_none());
    }

    #[test]
    fn every_parent_of_the_layer_is_read_from_the_base() {
        let artifact = artifact(false);
        let mut base = base();
        base.entries
            .retain(|path, _| !BASE_DIRS.contains(&path.as_str()));
        let layer = image_layer(&inputs(&artifact), &base).unwrap();
        assert_eq!(layer.parents_without_entries(), BASE_DIRS.to_vec());
    }

    #[test]
    fn a_corrupted_artifact_fails_before_the_image_is_built() {
        let artifact = artifact(true);
        let error = image_layer(&inputs(&artifact), &base())
            .expect_err("a corrupted artifact is an error")
            .to_string();
        assert!(
            error.starts_with("the artifact fails its SHA256SUMS: ember: expected SHA-256 "),
            "{error}"
        );
    }

    #[test]
    fn a_base_that_has_the_user_or_its_id_is_refused() {
        let artifact = artifact(false);
        let mut base = base();
        let (mode, uid, gid) = (0o644, 0, 0);
        base.entries.insert(
            "etc/passwd".into(),
            Entry::file(
                b"app:x:10001:10001::/app:/bin/sh\n".to_vec(),
                mode,
                uid,
                gid,
            ),
        );
        assert_eq!(
            image_layer(&inputs(&artifact), &base).err().unwrap().to_string(),
            "the base image's /etc/passwd already uses id 10001: \"app:x:10001:10001::/app:/bin/sh\"; the image needs it for ember"
        );
    }
}
