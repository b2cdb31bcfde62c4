//! A COPY step's files as the upload the gateway unpacks inside the build
//! sandbox: a tar of the source, named as in the build context, links kept
//! as links (never followed out of the context).

use std::path::{Component, Path};

use anyhow::{Context, bail};
use sha2::{Digest, Sha256};

/// `src` (relative to `context`) as a tar whose members start with `src`.
pub fn pack(context: &Path, src: &str) -> anyhow::Result<Vec<u8>> {
    let relative = Path::new(src.trim_end_matches('/'));
    if src.contains(['*', '?', '[']) {
        bail!("COPY {src}: wildcards are not supported by the CLI; name the files or use the SDK");
    }
    if relative.components().any(|c| !matches!(c, Component::Normal(_) | Component::CurDir)) {
        bail!("COPY {src}: the source must stay inside the build context");
    }
    let full = context.join(relative);
    let meta = std::fs::symlink_metadata(&full).with_context(|| format!("COPY {src}: {}", full.display()))?;
    let mut tar = tar::Builder::new(Vec::new());
    tar.follow_symlinks(false);
    let name = if relative.as_os_str().is_empty() { Path::new(".") } else { relative };
    if meta.is_dir() {
        tar.append_dir_all(name, &full)?;
    } else {
        tar.append_path_with_name(&full, name)?;
    }
    Ok(tar.into_inner()?)
}

/// The upload's name when the definition carries none: its content and
/// where it goes, so a changed file or destination is uploaded again.
pub fn hash(args: &[String], tar: &[u8]) -> String {
    let mut sha = Sha256::new();
    for arg in args {
        sha.update(arg.as_bytes());
        sha.update([0]);
    }
    sha.update(tar);
    sha.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packs_a_tree_with_its_links_and_refuses_escapes() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("app/sub")).unwrap();
        std::fs::write(dir.path().join("app/sub/a.txt"), "a").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join("app/link")).unwrap();
        let tar = pack(dir.path(), "app/").unwrap();
        let mut names: Vec<(String, bool)> = tar::Archive::new(&tar[..])
            .entries()
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (e.path().unwrap().display().to_string(), e.header().entry_type().is_symlink())
            })
            .collect();
        names.sort();
        assert!(names.contains(&("app/link".into(), true)), "{names:?}");
        assert!(names.contains(&("app/sub/a.txt".into(), false)), "{names:?}");
        for bad in ["../x", "/etc", "app/*.txt"] {
            assert!(pack(dir.path(), bad).is_err(), "{bad}");
        }
        assert_ne!(hash(&["a".into()], &tar), hash(&["b".into()], &tar));
    }
}
