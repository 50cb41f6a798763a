//! Per-client rate limiting (config `limits.rate_limit`): a token bucket per caller key
//! (auth identity, else address), checked by the runner before anything else so that probing
//! the policy costs tokens too. `docs/policy.md` describes the behaviour.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use crate::caller::Caller;
use crate::contract::{ErrorBody, ErrorCode};
use crate::limits::RateLimitConfig;

/// A token bucket per client key.
pub(crate) struct RateLimiter {
    per_sec: f64,
    burst: f64,
    buckets: Mutex<HashMap<String, Bucket>>,
}

#[derive(Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// Above this many tracked clients, full (idle) buckets are forgotten.
const PRUNE_ABOVE: usize = 4096;

impl RateLimiter {
    pub(crate) fn new(config: &RateLimitConfig) -> Self {
        Self {
            per_sec: f64::from(config.per_minute) / 60.0,
            burst: f64::from(config.burst.max(1)),
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes one token for `key` at `now`; `Err(secs)` is how long until one is there.
    pub(crate) fn take_at(&self, key: &str, now: Instant) -> Result<(), u64> {
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if buckets.len() > PRUNE_ABOVE {
            let (rate, burst) = (self.per_sec, self.burst);
            buckets.retain(|_, b| {
                b.tokens + now.saturating_duration_since(b.at).as_secs_f64() * rate < burst
            });
        }
        let b = buckets.entry(key.to_owned()).or_insert(Bucket {
            tokens: self.burst,
            at: now,
        });
        let elapsed = now.saturating_duration_since(b.at).as_secs_f64();
        b.tokens = (b.tokens + elapsed * self.per_sec).min(self.burst);
        b.at = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            Ok(())
        } else if self.per_sec <= 0.0 {
            Err(60)
        } else {
            Err(((1.0 - b.tokens) / self.per_sec).ceil().max(1.0) as u64)
        }
    }

    /// Takes one token for `caller`, or a 429 with `Retry-After`.
    pub(crate) fn take(&self, caller: &Caller) -> Result<(), RateLimited> {
        self.take_at(&caller.key(), Instant::now())
            .map_err(|secs| RateLimited {
                who: caller.describe(),
                per_minute: (self.per_sec * 60.0).round(),
                burst: self.burst,
                secs,
            })
    }
}

/// A caller over its rate: `429 too_many_requests` with `Retry-After: secs`.
#[derive(Debug, thiserror::Error)]
#[error(
    "rate limit: {who} is over limits.rate_limit ({per_minute} per minute, burst {burst}); retry in {secs} s"
)]
pub(crate) struct RateLimited {
    who: String,
    per_minute: f64,
    burst: f64,
    secs: u64,
}

impl From<RateLimited> for ErrorBody {
    fn from(e: RateLimited) -> Self {
        ErrorBody::new(ErrorCode::TooManyRequests, e.to_string()).retry_after(e.secs)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn token_bucket() {
        let rl = RateLimiter::new(&RateLimitConfig {
            per_minute: 60,
            burst: 2,
        });
        let t0 = Instant::now();
        assert!(rl.take_at("a", t0).is_ok());
        assert!(rl.take_at("a", t0).is_ok());
        assert_eq!(rl.take_at("a", t0), Err(1));
        // Another client has its own bucket.
        assert!(rl.take_at("b", t0).is_ok());
        // One token per second comes back.
        assert!(rl.take_at("a", t0 + Duration::from_millis(1000)).is_ok());
        assert!(rl.take_at("a", t0 + Duration::from_millis(1500)).is_err());
        let slow = RateLimiter::new(&RateLimitConfig {
            per_minute: 2,
            burst: 1,
        });
        assert!(slow.take_at("a", t0).is_ok());
        assert_eq!(slow.take_at("a", t0), Err(30));
    }
}
