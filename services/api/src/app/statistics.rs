//! Keeping the planner's statistics of the hot tables (`db::statistics`).

use super::App;
use crate::{db, error::AppResult};

impl App {
    /// Analyses the hot tables past 1,000 rows that have doubled since
    /// their last analysis; how many it analysed.
    pub async fn keep_statistics(&self) -> AppResult<usize> {
        let mut analysed = 0;
        for table in db::statistics::stale(&self.db).await? {
            let started = std::time::Instant::now();
            if !db::statistics::analyze(&self.db, &table).await? {
                break;
            }
            analysed += 1;
            tracing::info!(table = %table, ms = started.elapsed().as_millis() as u64, "analysed a table that had doubled since its last analysis");
        }
        Ok(analysed)
    }
}
