//! Processes under measurement: their CPU seconds and resident memory, read
//! from /proc.

use std::{fs, time::Duration};

/// Clock ticks per second for /proc/<pid>/stat times (Linux's USER_HZ).
const TICKS: f64 = 100.0;

/// CPU seconds (user + system) a process has used, plus what its exited
/// children used (so Postgres backends that come and go are still counted,
/// through the postmaster that reaped them).
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces; fields resume after its ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let field = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok());
    Some((field(11)? + field(12)? + field(13)? + field(14)?) / TICKS)
}

/// Proportional set size in bytes: shared pages are divided among the
/// processes sharing them, so summing over Postgres's processes does not
/// count its shared buffers once per backend.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let rollup = fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    let line = rollup.lines().find(|l| l.starts_with("Pss:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

/// Every process whose command name is `name` (e.g. all postgres backends).
pub fn pids_named(name: &str) -> Vec<u32> {
    let Ok(dir) = fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == name))
        .collect()
}

/// A group of processes measured together (Postgres is many).
#[derive(Debug, Clone)]
pub enum Target {
    Pids(Vec<u32>),
    Named(&'static str),
}

impl Target {
    fn pids(&self) -> Vec<u32> {
        match self {
            Self::Pids(p) => p.clone(),
            Self::Named(n) => pids_named(n),
        }
    }

    pub fn cpu(&self) -> f64 {
        self.pids().into_iter().filter_map(cpu_seconds).sum()
    }

    pub fn rss(&self) -> u64 {
        self.pids().into_iter().filter_map(rss_bytes).sum()
    }
}

/// Samples peak RSS of each target every `every` until stopped.
pub struct PeakSampler {
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<Vec<u64>>,
}

impl PeakSampler {
    pub fn start(targets: Vec<Target>, every: Duration) -> Self {
        let (stop, mut rx) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(async move {
            let mut peaks = vec![0u64; targets.len()];
            loop {
                for (i, t) in targets.iter().enumerate() {
                    peaks[i] = peaks[i].max(t.rss());
                }
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = rx.changed() => return peaks,
                }
            }
        });
        Self { stop, task }
    }

    pub async fn finish(self) -> Vec<u64> {
        let _ = self.stop.send(true);
        self.task.await.unwrap_or_default()
    }
}
