//! The gateway's own limit on its request rate to the API server (`kubernetes.api_qps`,
//! `kubernetes.api_burst`), as client-go's token bucket: a burst of `burst` calls, then
//! `qps` per second. Busy API servers answer floods with 429s; better not to cause them.

use std::time::Duration;

use tokio::sync::Mutex;
use tokio::time::Instant;

pub(super) struct Throttle {
    qps: f64,
    burst: f64,
    state: Mutex<Bucket>,
}

struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Throttle {
    pub(super) fn new(qps: f64, burst: u32) -> Self {
        let burst = f64::from(burst.max(1));
        Self {
            qps,
            burst,
            state: Mutex::new(Bucket {
                tokens: burst,
                at: Instant::now(),
            }),
        }
    }

    /// Waits for a token. Callers queue in order (the mutex is fair).
    pub(super) async fn acquire(&self) {
        if self.qps <= 0.0 {
            return;
        }
        let mut b = self.state.lock().await;
        let now = Instant::now();
        b.tokens = (b.tokens + now.duration_since(b.at).as_secs_f64() * self.qps).min(self.burst);
        b.at = now;
        if b.tokens < 1.0 {
            let wait = Duration::from_secs_f64((1.0 - b.tokens) / self.qps);
            // Held while sleeping: the next caller waits behind this one.
            tokio::time::sleep(wait).await;
            b.tokens = 1.0;
            b.at = Instant::now();
        }
        b.tokens -= 1.0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_burst_then_the_rate() {
        let t = Throttle::new(10.0, 3);
        let start = Instant::now();
        for _ in 0..3 {
            t.acquire().await;
        }
        assert!(
            start.elapsed() < Duration::from_millis(1),
            "the burst is free"
        );
        for _ in 0..5 {
            t.acquire().await;
        }
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(490) && took <= Duration::from_millis(600),
            "{took:?}"
        );
        let off = Throttle::new(0.0, 1);
        for _ in 0..100 {
            off.acquire().await;
        }
    }
}
