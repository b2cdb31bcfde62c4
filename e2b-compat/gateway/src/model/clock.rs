//! Wall-clock time as the records keep it: Unix milliseconds.

use time::OffsetDateTime;

pub fn now_ms() -> i64 {
    (OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000) as i64
}
