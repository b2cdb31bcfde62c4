//! Template builds: a ZFS dataset populated from the release's `base.txz`
//! plus pkg(8) packages, frozen as `@base`.
//!
//! The build never runs code from the network as root on the host except
//! what pkg(8) itself runs for package scripts and the recipe's own
//! post-install commands, both inside the new root.

use std::path::{Path, PathBuf};

use super::{
    AGENT_DIR_IN_JAIL, Cmd, Layout, PROP_BUILT_AT, PROP_RECIPE, PROP_TEMPLATE, Step, TEMPLATE_SNAPSHOT, mounts, tool,
    zfs,
};
use copse_substrate::template::{Recipe, SANDBOX_HOME, SANDBOX_UID, SANDBOX_USER};

/// Operators without internet access point this at a directory holding
/// `base.txz` and `MANIFEST`, or at another mirror's URL.
pub const ENV_DIST: &str = "COPSE_FREEBSD_DIST";
pub const PROP_RELEASE: &str = "copse:release";

/// Where `base.txz` comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DistSource {
    /// Directory URL containing `base.txz` and `MANIFEST`.
    Url(String),
    /// Local directory with the same two files.
    Dir(PathBuf),
}

/// `freebsd-version -u` prints e.g. `15.0-RELEASE-p2`; release sets are
/// published per release (`15.0-RELEASE`), the patch level is not part of
/// the path. Only RELEASE, BETA and RC builds have sets on the mirrors.
pub fn release_of(freebsd_version: &str) -> Result<String, String> {
    let v = freebsd_version.trim();
    let base = match v.rsplit_once("-p") {
        Some((head, patch)) if !patch.is_empty() && patch.chars().all(|c| c.is_ascii_digit()) => head,
        _ => v,
    };
    let published = ["-RELEASE", "-BETA", "-RC"].iter().any(|kind| {
        base.split_once(kind).is_some_and(|(ver, n)| !ver.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
    });
    if published {
        Ok(base.to_string())
    } else {
        Err(format!("no published release sets for {v:?}: set {ENV_DIST} to a directory or URL with base.txz"))
    }
}

/// Mirror path component for a Rust target architecture.
pub fn dist_arch(rust_arch: &str) -> Option<&'static str> {
    match rust_arch {
        "x86_64" => Some("amd64"),
        "aarch64" => Some("arm64/aarch64"),
        _ => None,
    }
}

pub fn dist_source(env_override: Option<&str>, release: &str, arch: &str) -> DistSource {
    match env_override {
        Some(v) if v.contains("://") => DistSource::Url(v.trim_end_matches('/').to_string()),
        Some(v) => DistSource::Dir(PathBuf::from(v)),
        None => DistSource::Url(format!("https://download.freebsd.org/releases/{arch}/{release}")),
    }
}

/// The sha256 of `entry` in a release MANIFEST (tab-separated: file,
/// sha256, file count, set name, description, default selection).
pub fn manifest_sha256(manifest: &str, entry: &str) -> Option<String> {
    manifest.lines().find_map(|line| {
        let mut cols = line.split('\t');
        (cols.next()? == entry).then_some(())?;
        let sum = cols.next()?.trim();
        (sum.len() == 64 && sum.chars().all(|c| c.is_ascii_hexdigit())).then(|| sum.to_ascii_lowercase())
    })
}

/// A stable fingerprint of a recipe (FNV-1a 64), recorded on the snapshot
/// so an operator can tell which recipe a template was built from.
pub fn recipe_hash(recipe: &Recipe) -> String {
    let mut text = recipe.name.clone();
    for part in [&recipe.packages, &recipe.post_install] {
        text.push('\0');
        text.push_str(&part.join("\n"));
    }
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// Everything a build plan depends on besides the layout.
#[derive(Debug, Clone)]
pub struct BuildInputs<'a> {
    pub recipe: &'a Recipe,
    pub release: String,
    pub source: DistSource,
    /// A dataset from an earlier, unfinished build exists (no `@base`).
    pub unfinished: bool,
    /// Unix seconds to record as the build time.
    pub built_at: u64,
}

pub fn build(layout: &Layout, input: &BuildInputs<'_>) -> Vec<Step> {
    let name = &input.recipe.name;
    let dataset = layout.template_dataset(name);
    let root = layout.template_root(name);
    let at = |p: &str| root.join(p.trim_start_matches('/'));
    let root_s = root.display().to_string();
    let total = 7;
    let progress = |n: u32, what: String| Step::Progress(format!("template {name}: [{n}/{total}] {what}"));
    let mut steps = Vec::new();

    if input.unfinished {
        steps.push(Step::Progress(format!("template {name}: removing an unfinished earlier build")));
        steps.extend(undo(layout, name));
    }

    steps.push(progress(1, format!("creating dataset {dataset}")));
    steps.push(Step::Run(Cmd::new(
        tool::ZFS,
        [
            "create".to_string(),
            "-o".into(),
            format!("mountpoint={root_s}"),
            "-o".into(),
            "compression=lz4".into(),
            "-o".into(),
            "atime=off".into(),
            "-o".into(),
            format!("{PROP_TEMPLATE}={name}"),
            dataset.clone(),
        ],
    )));

    steps.push(progress(2, format!("getting base.txz of {}", input.release)));
    let (base, manifest) = match &input.source {
        DistSource::Url(url) => {
            let dir = layout.dist_dir(&input.release);
            steps.push(Step::RealDir { path: dir.clone(), below: layout.state_dir.clone(), mode: 0o755 });
            let (base, manifest) = (dir.join("base.txz"), dir.join("MANIFEST"));
            for (file, remote) in [(&manifest, "MANIFEST"), (&base, "base.txz")] {
                // -m: mirror mode, so a cached copy of the right size and
                // date is not downloaded again.
                steps.push(Step::Run(
                    Cmd::new(
                        tool::FETCH,
                        ["-m".to_string(), "-o".into(), file.display().to_string(), format!("{url}/{remote}")],
                    )
                    .streamed(),
                ));
            }
            (base, manifest)
        }
        DistSource::Dir(dir) => (dir.join("base.txz"), dir.join("MANIFEST")),
    };
    steps.push(Step::VerifySha256 { file: base.clone(), manifest, entry: "base.txz".into() });

    steps.push(progress(3, "extracting base.txz".into()));
    steps.push(Step::Run(Cmd::new(tool::TAR, ["-x", "-p", "-f", &base.display().to_string(), "-C", &root_s])));

    // Package and post-install scripts expect /dev/null and friends.
    steps.push(Step::RealDir { path: at("/dev"), below: root.clone(), mode: 0o555 });
    steps.push(Step::Run(Cmd::new(tool::MOUNT, ["-t", "devfs", "devfs", &at("/dev").display().to_string()])));

    if input.recipe.packages.is_empty() {
        steps.push(progress(4, "no packages to install".into()));
    } else {
        steps.push(progress(4, format!("installing packages: {}", input.recipe.packages.join(" "))));
        let mut args = vec!["-r".to_string(), root_s.clone(), "install".into(), "-y".into()];
        args.extend(input.recipe.packages.iter().cloned());
        steps.push(Step::Run(Cmd::new(tool::PKG, args).env("ASSUME_ALWAYS_YES", "yes").streamed()));
        steps
            .push(Step::Run(Cmd::new(tool::PKG, ["-r", &root_s, "clean", "-a", "-y"]).env("ASSUME_ALWAYS_YES", "yes")));
    }

    steps.push(progress(5, format!("adding user {SANDBOX_USER} ({SANDBOX_UID})")));
    let uid = SANDBOX_UID.to_string();
    steps.push(Step::Run(Cmd::new(tool::PW, ["-R", &root_s, "groupadd", "-n", SANDBOX_USER, "-g", &uid])));
    steps.push(Step::Run(Cmd::new(
        tool::PW,
        [
            "-R",
            &root_s,
            "useradd",
            "-n",
            SANDBOX_USER,
            "-u",
            &uid,
            "-g",
            &uid,
            "-c",
            "copse sandbox user",
            "-d",
            SANDBOX_HOME,
            "-m",
            "-s",
            "/bin/sh",
        ],
    )));
    steps.push(Step::RealDir { path: at(AGENT_DIR_IN_JAIL), below: root.clone(), mode: 0o755 });

    if input.recipe.post_install.is_empty() {
        steps.push(progress(6, "no post-install commands".into()));
    } else {
        steps.push(progress(6, format!("running {} post-install command(s)", input.recipe.post_install.len())));
        // Name resolution for commands that download; removed again so the
        // host's resolver settings do not ship in the template.
        let resolv = at("/etc/resolv.conf");
        steps.push(Step::CopyFile { from: "/etc/resolv.conf".into(), to: resolv.clone(), mode: 0o644 });
        for command in &input.recipe.post_install {
            steps.push(Step::Run(Cmd::new(tool::CHROOT, [root_s.as_str(), "/bin/sh", "-c", command]).streamed()));
        }
        steps.push(Step::RemoveFile { path: resolv });
    }

    steps.push(progress(7, format!("freezing {dataset}@{TEMPLATE_SNAPSHOT}")));
    steps.push(Step::Run(mounts::unmount(&at("/dev"))));
    // Templates never change after the snapshot; clones are writable (the
    // clone command sets readonly=off).
    steps.push(Step::Run(Cmd::new(tool::ZFS, ["set", "readonly=on", &dataset])));
    steps.push(Step::Run(Cmd::new(
        tool::ZFS,
        [
            "snapshot".to_string(),
            "-o".into(),
            format!("{PROP_BUILT_AT}={}", input.built_at),
            "-o".into(),
            format!("{PROP_RECIPE}={}", recipe_hash(input.recipe)),
            "-o".into(),
            format!("{PROP_RELEASE}={}", input.release),
            layout.template_snapshot(name),
        ],
    )));
    steps
}

/// Removes whatever a failed or unfinished build left: best effort, since
/// it runs after an error and must not mask it.
pub fn undo(layout: &Layout, name: &str) -> Vec<Step> {
    let dev = layout.template_root(name).join("dev");
    vec![
        Step::Run(mounts::unmount(&dev).may_fail()),
        Step::Run(zfs::destroy(&layout.template_dataset(name)).may_fail()),
    ]
}

/// `freebsd-version -u`: the userland release whose sets to use.
pub fn host_release() -> Cmd {
    Cmd::new(tool::FREEBSD_VERSION, ["-u"])
}

/// `sha256 -q FILE` prints the bare digest.
pub fn sha256_of(file: &Path) -> Cmd {
    Cmd::new(tool::SHA256, ["-q".to_string(), file.display().to_string()])
}

#[cfg(test)]
mod tests {
    use super::super::render;
    use super::super::testing::*;
    use super::*;

    fn recipe(post: &[&str]) -> Recipe {
        Recipe {
            name: "base".into(),
            packages: vec!["python311".into(), "py311-pip".into()],
            post_install: post.iter().map(|s| s.to_string()).collect(),
            backend: Default::default(),
        }
    }

    #[test]
    fn releases_and_mirrors() {
        assert_eq!(release_of("15.0-RELEASE-p2\n").unwrap(), "15.0-RELEASE");
        assert_eq!(release_of("15.0-RELEASE").unwrap(), "15.0-RELEASE");
        assert_eq!(release_of("15.1-RC2").unwrap(), "15.1-RC2");
        assert!(release_of("16.0-CURRENT").is_err());
        assert!(release_of("15.0-STABLE").is_err());
        assert_eq!(dist_arch("x86_64"), Some("amd64"));
        assert_eq!(dist_arch("aarch64"), Some("arm64/aarch64"));
        assert_eq!(
            dist_source(None, "15.0-RELEASE", "amd64"),
            DistSource::Url("https://download.freebsd.org/releases/amd64/15.0-RELEASE".into())
        );
        assert_eq!(dist_source(Some("/srv/dist/"), "x", "y"), DistSource::Dir("/srv/dist/".into()));
        assert_eq!(dist_source(Some("http://mirror/rel/"), "x", "y"), DistSource::Url("http://mirror/rel".into()));
    }

    #[test]
    fn manifest_gives_the_base_digest() {
        let manifest = "base-dbg.txz\t2a3c2b0d8d2c6f6f1f0c9b1d5d0c3c0e5a9f1e2d3c4b5a69788796a5b4c3d2e1\t612\tbase-dbg\t\"Base system (Debugging)\"\toff\n\
base.txz\tA1B2C3D4E5F60718293A4B5C6D7E8F90A1B2C3D4E5F60718293A4B5C6D7E8F90\t29714\tbase\t\"Base system (MANDATORY)\"\ton\n\
kernel.txz\t0000000000000000000000000000000000000000000000000000000000000000\t920\tkernel\t\"Kernel (MANDATORY)\"\ton\n";
        assert_eq!(
            manifest_sha256(manifest, "base.txz").as_deref(),
            Some("a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f90")
        );
        assert_eq!(manifest_sha256(manifest, "lib32.txz"), None);
        assert_eq!(manifest_sha256("base.txz\tnot-a-digest\n", "base.txz"), None);
    }

    #[test]
    fn recipe_hash_is_stable_and_sensitive() {
        assert_eq!(recipe_hash(&recipe(&[])), recipe_hash(&recipe(&[])));
        assert_ne!(recipe_hash(&recipe(&[])), recipe_hash(&recipe(&["true"])));
        assert_eq!(recipe_hash(&recipe(&[])).len(), 16);
    }

    #[test]
    fn build_plan_golden() {
        let r = recipe(&[]);
        let input = BuildInputs {
            recipe: &r,
            release: "15.0-RELEASE".into(),
            source: DistSource::Url("https://download.freebsd.org/releases/amd64/15.0-RELEASE".into()),
            unfinished: false,
            built_at: 1763769600,
        };
        let hash = recipe_hash(&r);
        let expected = format!(
            "
progress template base: [1/7] creating dataset zroot/copse/templates/base
run /sbin/zfs create -o mountpoint=/var/db/copse/templates/base -o compression=lz4 -o atime=off -o copse:template=base zroot/copse/templates/base
progress template base: [2/7] getting base.txz of 15.0-RELEASE
realdir /var/db/copse/dist/15.0-RELEASE mode=755 nosymlinks-below=/var/db/copse
run /usr/bin/fetch -m -o /var/db/copse/dist/15.0-RELEASE/MANIFEST https://download.freebsd.org/releases/amd64/15.0-RELEASE/MANIFEST
run /usr/bin/fetch -m -o /var/db/copse/dist/15.0-RELEASE/base.txz https://download.freebsd.org/releases/amd64/15.0-RELEASE/base.txz
verify-sha256 /var/db/copse/dist/15.0-RELEASE/base.txz against /var/db/copse/dist/15.0-RELEASE/MANIFEST entry base.txz
progress template base: [3/7] extracting base.txz
run /usr/bin/tar -x -p -f /var/db/copse/dist/15.0-RELEASE/base.txz -C /var/db/copse/templates/base
realdir /var/db/copse/templates/base/dev mode=555 nosymlinks-below=/var/db/copse/templates/base
run /sbin/mount -t devfs devfs /var/db/copse/templates/base/dev
progress template base: [4/7] installing packages: python311 py311-pip
run ASSUME_ALWAYS_YES=yes /usr/sbin/pkg -r /var/db/copse/templates/base install -y python311 py311-pip
run ASSUME_ALWAYS_YES=yes /usr/sbin/pkg -r /var/db/copse/templates/base clean -a -y
progress template base: [5/7] adding user user (1000)
run /usr/sbin/pw -R /var/db/copse/templates/base groupadd -n user -g 1000
run /usr/sbin/pw -R /var/db/copse/templates/base useradd -n user -u 1000 -g 1000 -c 'copse sandbox user' -d /home/user -m -s /bin/sh
realdir /var/db/copse/templates/base/.copse mode=755 nosymlinks-below=/var/db/copse/templates/base
progress template base: [6/7] no post-install commands
progress template base: [7/7] freezing zroot/copse/templates/base@base
run /sbin/umount -f /var/db/copse/templates/base/dev
run /sbin/zfs set readonly=on zroot/copse/templates/base
run /sbin/zfs snapshot -o copse:built_at=1763769600 -o copse:recipe={hash} -o copse:release=15.0-RELEASE zroot/copse/templates/base@base
"
        );
        assert_golden(&render(&build(&layout(), &input)), &expected);
    }

    #[test]
    fn build_from_a_local_dist_after_an_unfinished_one_with_post_install() {
        let r = Recipe {
            name: "ci".into(),
            packages: vec![],
            post_install: vec!["pip install numpy".into()],
            backend: Default::default(),
        };
        let input = BuildInputs {
            recipe: &r,
            release: "15.0-RELEASE".into(),
            source: DistSource::Dir("/srv/dist".into()),
            unfinished: true,
            built_at: 1,
        };
        let plan = render(&build(&layout(), &input));
        let head: Vec<&str> = plan.lines().take(5).collect();
        assert_eq!(
            head,
            [
                "progress template ci: removing an unfinished earlier build",
                "run /sbin/umount -f /var/db/copse/templates/ci/dev",
                "run /sbin/zfs destroy -r -f zroot/copse/templates/ci",
                "progress template ci: [1/7] creating dataset zroot/copse/templates/ci",
                "run /sbin/zfs create -o mountpoint=/var/db/copse/templates/ci -o compression=lz4 -o atime=off -o copse:template=ci zroot/copse/templates/ci",
            ]
        );
        assert!(!plan.contains("/usr/bin/fetch"));
        assert!(plan.contains("verify-sha256 /srv/dist/base.txz against /srv/dist/MANIFEST entry base.txz\n"));
        assert!(plan.contains("progress template ci: [4/7] no packages to install\n"));
        assert!(plan.contains(
            "copy /etc/resolv.conf /var/db/copse/templates/ci/etc/resolv.conf mode=644\n\
             run /usr/sbin/chroot /var/db/copse/templates/ci /bin/sh -c 'pip install numpy'\n\
             remove /var/db/copse/templates/ci/etc/resolv.conf\n"
        ));
    }

    #[test]
    fn undo_is_best_effort() {
        assert!(undo(&layout(), "base").iter().all(|s| matches!(s, Step::Run(c) if c.may_fail)));
    }
}
