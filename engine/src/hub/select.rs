//! Which GGUF file(s) of a repository a quant names: the file whose name carries the quant as
//! a whole word (`Q4_K` does not pick `Q4_K_M`, `Q4_XS` does not pick `IQ4_XS`), or every part
//! of a split GGUF (`NAME-00001-of-00003.gguf`). Multimodal projectors are never picked.

use std::collections::BTreeMap;

use super::api::RepoFile;
use super::{HubError, DEFAULT_QUANT};

/// Splits `NAME-00001-of-00003.gguf` into (`NAME`, part 1, of 3).
pub fn split_part(path: &str) -> Option<(&str, usize, usize)> {
    let stem = path.strip_suffix(".gguf")?;
    let (rest, total) = stem.rsplit_once("-of-")?;
    let (prefix, part) = rest.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(part) || !digits(total) {
        return None;
    }
    let (part, total) = (part.parse().ok()?, total.parse().ok()?);
    (part >= 1 && part <= total).then_some((prefix, part, total))
}

/// Whether the file's name carries `quant` (upper case) as a whole word.
pub fn has_quant(path: &str, quant: &str) -> bool {
    let name = path.to_ascii_uppercase();
    let bytes = name.as_bytes();
    let mut from = 0;
    while let Some(at) = name[from..].find(quant) {
        let start = from + at;
        let end = start + quant.len();
        let before_ok = start == 0 || matches!(bytes[start - 1], b'-' | b'.' | b'/' | b'_');
        let after_ok = end == bytes.len() || matches!(bytes[end], b'-' | b'.' | b'/');
        if before_ok && after_ok {
            return true;
        }
        from = start + 1;
    }
    false
}

/// A model GGUF: `.gguf`, not a multimodal projector.
fn is_model_gguf(path: &str) -> bool {
    let lower = path.to_ascii_lowercase();
    lower.ends_with(".gguf") && !lower.rsplit('/').next().unwrap_or("").contains("mmproj")
}

/// The GGUF files of a repository grouped into sets: a single file, or the parts of one split
/// model in part order. Keyed by the set's name (the file, or the split prefix).
fn sets(files: &[RepoFile]) -> BTreeMap<String, Vec<&RepoFile>> {
    let mut sets: BTreeMap<String, Vec<&RepoFile>> = BTreeMap::new();
    for file in files.iter().filter(|f| is_model_gguf(&f.path)) {
        let key = match split_part(&file.path) {
            Some((prefix, _, total)) => format!("{prefix}-of-{total:05}"),
            None => file.path.clone(),
        };
        sets.entry(key).or_default().push(file);
    }
    for set in sets.values_mut() {
        set.sort_by_key(|f| split_part(&f.path).map_or(0, |(_, part, _)| part));
    }
    sets
}

/// The quants of the GGUF sets, for error messages (the set names when no quant is visible).
fn available(sets: &BTreeMap<String, Vec<&RepoFile>>) -> String {
    let names: Vec<&str> = sets.values().map(|s| s[0].path.as_str()).collect();
    names.join(", ")
}

/// The files to fetch for `quant` (default [`DEFAULT_QUANT`]; without it, a repository with a
/// single GGUF set gives that set), in part order, each with its SHA-256.
pub fn pick(
    repo: &str,
    quant: Option<&str>,
    files: &[RepoFile],
) -> Result<Vec<RepoFile>, HubError> {
    let sets = sets(files);
    if sets.is_empty() {
        return Err(HubError::NoGguf {
            repo: repo.to_string(),
        });
    }
    let wanted = quant.unwrap_or(DEFAULT_QUANT);
    let matching: Vec<&Vec<&RepoFile>> = sets
        .values()
        .filter(|set| has_quant(&set[0].path, wanted))
        .collect();
    let set = match (matching.as_slice(), quant) {
        ([one], _) => *one,
        ([], None) if sets.len() == 1 => sets.values().next().expect("one set"),
        ([], _) => {
            return Err(HubError::QuantNotFound {
                repo: repo.to_string(),
                quant: wanted.to_string(),
                available: available(&sets),
            })
        }
        (many, _) => {
            return Err(HubError::Ambiguous {
                repo: repo.to_string(),
                quant: wanted.to_string(),
                matches: many
                    .iter()
                    .map(|s| s[0].path.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
        }
    };
    if let Some((_, _, total)) = split_part(&set[0].path) {
        let parts: Vec<usize> = set
            .iter()
            .filter_map(|f| split_part(&f.path).map(|(_, part, _)| part))
            .collect();
        if parts != (1..=total).collect::<Vec<_>>() {
            return Err(HubError::IncompleteSplit {
                repo: repo.to_string(),
                file: set[0].path.clone(),
                expected: total,
                found: parts.len(),
            });
        }
    }
    set.iter()
        .map(|f| match &f.sha256 {
            Some(sha) if sha.len() == 64 && sha.bytes().all(|b| b.is_ascii_hexdigit()) => {
                Ok((*f).clone())
            }
            _ => Err(HubError::NoChecksum {
                repo: repo.to_string(),
                file: f.path.clone(),
            }),
        })
        .collect()
}

/// [`pick`] over file names only (the cache, where sizes and hashes are the blobs'): the paths
/// of the set, or `None`.
pub fn pick_names(quant: Option<&str>, paths: &[String]) -> Option<Vec<String>> {
    let files: Vec<RepoFile> = paths
        .iter()
        .map(|p| RepoFile {
            path: p.clone(),
            size: 0,
            sha256: Some("0".repeat(64)),
        })
        .collect();
    pick("", quant, &files)
        .ok()
        .map(|set| set.into_iter().map(|f| f.path).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(path: &str) -> RepoFile {
        RepoFile {
            path: path.to_string(),
            size: 1,
            sha256: Some("a".repeat(64)),
        }
    }

    fn check(quant: Option<&str>, paths: &[&str], expected: Result<&[&str], &str>) {
        let files: Vec<RepoFile> = paths.iter().map(|p| file(p)).collect();
        match (pick("o/r", quant, &files), expected) {
            (Ok(set), Ok(want)) => {
                let got: Vec<&str> = set.iter().map(|f| f.path.as_str()).collect();
                assert_eq!(got, want, "{quant:?} in {paths:?}");
            }
            (Err(e), Err(want)) => {
                let e = e.to_string();
                assert!(e.contains(want), "{quant:?} in {paths:?}: {e}");
            }
            (got, want) => panic!("{quant:?} in {paths:?}: got {got:?}, expected {want:?}"),
        }
    }

    #[test]
    fn quants_are_whole_words() {
        let repo = [
            "README.md",
            "m-IQ4_XS.gguf",
            "m-Q4_K.gguf",
            "m-Q4_K_M.gguf",
            "m-q8_0.gguf",
            "mmproj-m-Q4_K_M.gguf",
        ];
        check(None, &repo, Ok(&["m-Q4_K_M.gguf"]));
        check(Some("Q4_K"), &repo, Ok(&["m-Q4_K.gguf"]));
        check(Some("Q8_0"), &repo, Ok(&["m-q8_0.gguf"]));
        check(Some("IQ4_XS"), &repo, Ok(&["m-IQ4_XS.gguf"]));
        check(Some("Q4_XS"), &repo, Err("has no GGUF file for Q4_XS"));
        check(Some("Q6_K"), &repo, Err("m-IQ4_XS.gguf, m-Q4_K.gguf"));
        check(None, &["only.f16.gguf"], Ok(&["only.f16.gguf"]));
        check(
            None,
            &["a.f16.gguf", "a.bf16.gguf"],
            Err("no GGUF file for Q4_K_M"),
        );
        check(None, &["README.md"], Err("has no GGUF files"));
        check(
            Some("Q4_K_M"),
            &["a-Q4_K_M.gguf", "b-Q4_K_M.gguf"],
            Err("several"),
        );
    }

    #[test]
    fn split_files_come_as_a_set_in_order() {
        let repo = [
            "Q4_K_M/m-Q4_K_M-00002-of-00003.gguf",
            "Q4_K_M/m-Q4_K_M-00001-of-00003.gguf",
            "Q4_K_M/m-Q4_K_M-00003-of-00003.gguf",
            "m-Q8_0.gguf",
        ];
        check(
            None,
            &repo,
            Ok(&[
                "Q4_K_M/m-Q4_K_M-00001-of-00003.gguf",
                "Q4_K_M/m-Q4_K_M-00002-of-00003.gguf",
                "Q4_K_M/m-Q4_K_M-00003-of-00003.gguf",
            ]),
        );
        check(None, &repo[..2], Err("has 2 of its 3 parts"));
        assert_eq!(split_part("x-00001-of-00002.gguf"), Some(("x", 1, 2)));
        assert_eq!(split_part("x-00003-of-00002.gguf"), None);
        assert_eq!(split_part("x-1-of-2.gguf"), None);
    }

    #[test]
    fn files_without_a_hash_are_refused() {
        let mut f = file("m-Q4_K_M.gguf");
        f.sha256 = None;
        let e = pick("o/r", None, &[f]).unwrap_err().to_string();
        assert!(e.contains("no LFS SHA-256"), "{e}");
    }
}
