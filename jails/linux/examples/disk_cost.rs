//! What a sandbox's disk quota adds to create and destroy: a limited btrfs
//! subvolume (two ioctls) against the plain directories it replaces, on the
//! host's own file system. Run as root:
//! `cargo run --release -p copse-namespaces --example disk_cost -- [STATE_DIR] [N]`
//! (default: a fresh directory under /var/tmp, 200 rounds). The figures
//! quoted in docs/lifecycle.md come from this program.

#[cfg(not(target_os = "linux"))]
fn main() {
    eprintln!("disk_cost measures the Linux substrate");
}

#[cfg(target_os = "linux")]
fn main() -> anyhow::Result<()> {
    use std::fs;
    use std::path::Path;
    use std::time::{Duration, Instant};

    use copse_namespaces::disk::{Disk, volumes_dir};

    let mut args = std::env::args().skip(1);
    let state = args
        .next()
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| Path::new("/var/tmp").join(format!("copse-disk-cost-{}", std::process::id())));
    let rounds: usize = args.next().map(|n| n.parse()).transpose()?.unwrap_or(200);
    fs::create_dir_all(&state)?;

    let opened = Instant::now();
    let disk = Disk::open(&state)?;
    println!("open (mkfs and mount on first use): {:?}", opened.elapsed());

    let plain = state.join("plain");
    fs::create_dir_all(&plain)?;
    let mut dirs = (Vec::new(), Vec::new());
    let mut volumes = (Vec::new(), Vec::new());
    for i in 0..rounds {
        let id = format!("cost{i}");
        let started = Instant::now();
        let dir = plain.join(&id);
        fs::create_dir_all(dir.join("upper"))?;
        fs::create_dir_all(dir.join("work"))?;
        dirs.0.push(started.elapsed());
        let started = Instant::now();
        fs::remove_dir_all(&dir)?;
        dirs.1.push(started.elapsed());

        let started = Instant::now();
        let volume = disk.create(&id, 1024)?;
        fs::create_dir(volume.join("upper"))?;
        fs::create_dir(volume.join("work"))?;
        volumes.0.push(started.elapsed());
        let started = Instant::now();
        disk.remove(&id)?;
        volumes.1.push(started.elapsed());
    }
    let report = |what: &str, samples: &mut Vec<Duration>| {
        samples.sort();
        let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
        println!("{what:<36} p50 {:>9.3?}  p90 {:>9.3?}  max {:>9.3?}", at(0.5), at(0.9), at(1.0));
    };
    println!("{rounds} rounds, state dir {}", state.display());
    report("create: plain dirs (host fs)", &mut dirs.0);
    report("create: limited subvolume", &mut volumes.0);
    report("destroy: plain dirs", &mut dirs.1);
    report("destroy: subvolume", &mut volumes.1);
    let _ = nix::mount::umount2(&volumes_dir(&state), nix::mount::MntFlags::MNT_DETACH);
    fs::remove_dir_all(&state)?;
    Ok(())
}
