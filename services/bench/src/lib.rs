//! The Relay benchmark: drives the real api and dispatcher (as processes)
//! through the REST facade, receives on its own loopback server, and reports
//! throughput, publish→arrival latency, missing and duplicate deliveries, and
//! the CPU and memory of api, dispatcher and Postgres, with Postgres's
//! statements, WAL and commits per delivery, and draws each run as an SVG.

pub mod catalogue;
pub mod chart;
pub mod pgstats;
pub mod procs;
pub mod receiver;
pub mod report;
mod seed;
pub mod spec;
mod tenants;
pub mod workload;
