//! A token bucket per API key: a key may send its team's
//! `requests_per_second` on average, in bursts of as many. Buckets live in
//! memory; a restart forgets them, which only ever lets a caller through.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

struct Bucket {
    tokens: f64,
    at: Instant,
}

#[derive(Default)]
pub struct RateLimiter {
    buckets: Mutex<HashMap<Arc<str>, Bucket>>,
}

impl RateLimiter {
    /// Takes one request from `key`'s bucket, or says how long until one is
    /// available.
    pub fn check(&self, key: &Arc<str>, per_second: u64) -> Result<(), Duration> {
        self.check_at(key, per_second, Instant::now())
    }

    fn check_at(&self, key: &Arc<str>, per_second: u64, now: Instant) -> Result<(), Duration> {
        let rate = per_second.max(1) as f64;
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let bucket = buckets.entry(key.clone()).or_insert(Bucket { tokens: rate, at: now });
        let elapsed = now.saturating_duration_since(bucket.at).as_secs_f64();
        bucket.tokens = (bucket.tokens + elapsed * rate).min(rate);
        bucket.at = now;
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - bucket.tokens) / rate))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_of_the_rate_passes_then_the_key_waits() {
        let limiter = RateLimiter::default();
        let (a, b): (Arc<str>, Arc<str>) = ("a".into(), "b".into());
        let t0 = Instant::now();
        for _ in 0..2 {
            assert!(limiter.check_at(&a, 2, t0).is_ok());
        }
        let wait = limiter.check_at(&a, 2, t0).unwrap_err();
        assert!(wait > Duration::ZERO && wait <= Duration::from_millis(500), "{wait:?}");
        // Another key has its own bucket.
        assert!(limiter.check_at(&b, 2, t0).is_ok());
        // Half a second later one more request is allowed.
        assert!(limiter.check_at(&a, 2, t0 + Duration::from_millis(500)).is_ok());
        assert!(limiter.check_at(&a, 2, t0 + Duration::from_millis(500)).is_err());
    }
}
