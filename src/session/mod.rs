//! Sessions: a named runner that lives across calls (docs/sessions.md).
//!
//! A call that names a session runs in the session's [`KeptRunner`] instead of a fresh
//! runner; the first call with a name opens the session (the backend makes the runner from
//! the call's profile). Names are per caller (its identity, else its address): only the
//! caller that opened a session can use, list or end it. A session's calls run one at a time:
//! a call that finds another running waits for it (the phase `queued`, within its own
//! timeout) or, with `session_busy: fail`, fails at once with 409 `session_busy`.
//!
//! A session ends when its owner ends it, after its idle TTL, at its maximum lifetime, at
//! shutdown (unless every replica reaches its runner: then the runner is left to them, see
//! [`KeptRunner::leave`]), or when its runner is lost. An expired or lost session answers the next call
//! naming it with `session_expired` or `session_lost` (the reason), never silently with a
//! fresh runner; the call after that opens a new session.
//!
//! The sessions of this gateway are in its memory; what outlives the gateway is the runner
//! (a pod, labelled with its owner and expiry for the reaper, see [`KeepFor`]), which other
//! replicas find, adopt and list when the backend shares runners.

mod error;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::caller::Caller;
use crate::contract::{ErrorBody, Phase, RunContext, SessionBusy, SessionInfo};
use crate::exec::{
    ExecSpec, Executor, FoundRunner, Gone, KeepFor, KeptRunner, Progress, StartOptions,
};
use crate::metrics::Metrics;
use error::SessionError;

/// The `sessions:` section of the configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SessionConfig {
    /// Whether calls may name a session.
    pub enabled: bool,
    /// A session unused this long ends (seconds). Also the most a profile may set.
    pub idle_ttl_secs: u64,
    /// A session ends this long after it was opened, however busy (seconds). Also the most
    /// a profile may set.
    pub max_lifetime_secs: u64,
    /// Open sessions per caller.
    pub max_per_identity: usize,
    /// Open sessions on this gateway, all callers together.
    pub max_total: usize,
    /// Shorter lifetimes for sessions of some profiles (within the two values above).
    pub profiles: std::collections::BTreeMap<String, ProfileLifetime>,
}

/// A profile's session lifetimes; absent values are the section's.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProfileLifetime {
    pub idle_ttl_secs: Option<u64>,
    pub max_lifetime_secs: Option<u64>,
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            idle_ttl_secs: 15 * 60,
            max_lifetime_secs: 8 * 3600,
            max_per_identity: 4,
            max_total: 64,
            profiles: Default::default(),
        }
    }
}

impl SessionConfig {
    /// `(field, message)` on failure.
    pub fn validate(&self) -> Result<(), (String, String)> {
        let err = |f: &str, m: &str| Err((format!("sessions.{f}"), m.to_owned()));
        if self.idle_ttl_secs == 0 {
            return err("idle_ttl_secs", "must be at least 1");
        }
        if self.max_lifetime_secs < self.idle_ttl_secs {
            return err("max_lifetime_secs", "must be at least idle_ttl_secs");
        }
        if self.max_per_identity == 0 || self.max_total == 0 {
            return err("max_per_identity", "and max_total must be at least 1");
        }
        for (name, p) in &self.profiles {
            if p.idle_ttl_secs
                .is_some_and(|t| t == 0 || t > self.idle_ttl_secs)
            {
                return Err((
                    format!("sessions.profiles.{name}.idle_ttl_secs"),
                    format!(
                        "must be from 1 to sessions.idle_ttl_secs ({})",
                        self.idle_ttl_secs
                    ),
                ));
            }
            if p.max_lifetime_secs
                .is_some_and(|t| t == 0 || t > self.max_lifetime_secs)
            {
                return Err((
                    format!("sessions.profiles.{name}.max_lifetime_secs"),
                    format!(
                        "must be from 1 to sessions.max_lifetime_secs ({})",
                        self.max_lifetime_secs
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The idle TTL and maximum lifetime of a session of `profile`.
    fn lifetimes(&self, profile: &str) -> (Duration, Duration) {
        let p = self.profiles.get(profile);
        let idle = p
            .and_then(|p| p.idle_ttl_secs)
            .unwrap_or(self.idle_ttl_secs);
        let max = p
            .and_then(|p| p.max_lifetime_secs)
            .unwrap_or(self.max_lifetime_secs);
        // An idle TTL beyond the maximum lifetime would never apply.
        (Duration::from_secs(idle.min(max)), Duration::from_secs(max))
    }
}

/// `(owner key, name)`.
type Key = (String, String);

/// How long the answer for an expired or lost session is kept for its next call.
const TOMBSTONE_TTL: Duration = Duration::from_secs(3600);
/// The most such answers kept (the oldest go first).
const MAX_TOMBSTONES: usize = 4096;
/// Beyond its timeout, how long a call may hold its runner against other replicas (its kill
/// and its sync-back).
const CALL_SLACK: Duration = Duration::from_secs(30);

struct Session {
    name: String,
    owner: String,
    /// How the audit log names the owner.
    who: String,
    profile: String,
    runner: tokio::sync::OnceCell<Arc<dyn KeptRunner>>,
    context: Mutex<RunContext>,
    opened: Instant,
    idle_ttl: Duration,
    max_lifetime: Duration,
    last_used: Mutex<Instant>,
    calls: AtomicU64,
    running: AtomicBool,
    /// Held by the running call.
    busy: Arc<tokio::sync::Mutex<()>>,
    /// Fired when the session ends: kills its running call; waiting calls give up.
    ended: CancellationToken,
    /// Why it ended, for calls that waited for it.
    end_reason: Mutex<Option<ErrorBody>>,
}

impl Session {
    fn expired(&self, now: Instant) -> Option<String> {
        if now.duration_since(self.opened) >= self.max_lifetime {
            return Some(format!(
                "session {:?} reached its maximum lifetime of {} s",
                self.name,
                self.max_lifetime.as_secs()
            ));
        }
        let idle = self.idle(now);
        (!self.running.load(Ordering::Acquire) && idle >= self.idle_ttl).then(|| {
            format!(
                "session {:?} expired after {} s without a call (its idle TTL)",
                self.name,
                self.idle_ttl.as_secs()
            )
        })
    }

    /// How long nobody used it: on this replica, or (a runner every replica reaches) on any.
    fn idle(&self, now: Instant) -> Duration {
        let here = now.duration_since(*lock(&self.last_used));
        let anywhere = self
            .runner
            .get()
            .and_then(|r| r.last_used())
            .and_then(|t| SystemTime::now().duration_since(t).ok());
        match anywhere {
            Some(a) => here.min(a),
            None => here,
        }
    }

    fn info(&self, now: Instant) -> SessionInfo {
        let running = self.running.load(Ordering::Acquire);
        let idle = if running {
            Duration::ZERO
        } else {
            self.idle(now)
        };
        let to_idle = self.idle_ttl.saturating_sub(idle);
        let to_max = self
            .max_lifetime
            .saturating_sub(now.duration_since(self.opened));
        SessionInfo {
            name: self.name.clone(),
            profile: self.profile.clone(),
            context: lock(&self.context).clone(),
            age_secs: now.duration_since(self.opened).as_secs(),
            idle_secs: idle.as_secs(),
            expires_in_secs: to_idle.min(to_max).as_secs(),
            calls: self.calls.load(Ordering::Relaxed),
            busy: running,
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Default)]
struct State {
    open: HashMap<Key, Arc<Session>>,
    /// What the next call naming an expired or lost session gets, and since when.
    tombstones: HashMap<Key, (ErrorBody, Instant)>,
}

/// The sessions of a gateway.
pub(crate) struct Sessions {
    config: SessionConfig,
    state: Mutex<State>,
    metrics: Metrics,
    /// The gateway's shutdown: every session's `ended` is a child.
    stop: CancellationToken,
}

/// A call's hold on its session: the session's runner, for this call only; released
/// (the session idle again) when dropped.
pub(crate) struct SessionCall {
    session: Arc<Session>,
    runner: Arc<dyn KeptRunner>,
    number: u64,
    /// The runner's hold across replicas ([`KeptRunner::begin_call`]).
    hold: Option<String>,
    _busy: tokio::sync::OwnedMutexGuard<()>,
}

impl SessionCall {
    pub(crate) fn runner(&self) -> &Arc<dyn KeptRunner> {
        &self.runner
    }

    /// The token of this call's command: fired at shutdown and when the session ends.
    pub(crate) fn cancel(&self) -> CancellationToken {
        self.session.ended.child_token()
    }

    pub(crate) fn name(&self) -> &str {
        &self.session.name
    }

    /// 1 for the call that opened the session.
    pub(crate) fn number(&self) -> u64 {
        self.number
    }
}

impl Drop for SessionCall {
    fn drop(&mut self) {
        *lock(&self.session.last_used) = Instant::now();
        self.session.running.store(false, Ordering::Release);
        // Given back where other replicas see it; this replica's next call waits for the
        // local lock only (its own hold is its to take over).
        let (runner, hold) = (self.runner.clone(), self.hold.take());
        if hold.is_some()
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            rt.spawn(async move { runner.end_call(hold).await });
        }
    }
}

/// A hash naming an owner or a session in labels and forwarded names (never the identity).
pub(crate) fn label_hash(parts: &[&str]) -> String {
    let mut joined = Vec::new();
    for p in parts {
        joined.extend_from_slice(p.as_bytes());
        joined.push(0);
    }
    crate::workspace::hash_bytes(&joined)[..16].to_owned()
}

/// The name a session goes by on an upstream gateway (remote backend): every caller of this
/// gateway reaches the upstream with this gateway's one token, so a network caller's names
/// get a suffix of its identity's hash; a local caller (stdio) keeps its names.
pub(crate) fn forwarded_name(caller: &Caller, name: &str) -> String {
    if caller.local.is_some() && caller.identity.is_none() {
        return name.to_owned();
    }
    let cut = name.len().min(crate::contract::MAX_SESSION_NAME - 9);
    format!("{}-{}", &name[..cut], &label_hash(&[&caller.key()])[..8])
}

impl Sessions {
    /// Sessions ended by `stop` (the gateway's shutdown). Starts the task that expires idle
    /// sessions.
    pub(crate) fn new(
        config: SessionConfig,
        metrics: Metrics,
        stop: CancellationToken,
    ) -> Arc<Self> {
        let this = Arc::new(Self {
            config,
            state: Mutex::new(State::default()),
            metrics,
            stop,
        });
        let weak = Arc::downgrade(&this);
        let stop = this.stop.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = stop.cancelled() => return,
                }
                let Some(this) = weak.upgrade() else { return };
                this.expire(Instant::now());
            }
        });
        this
    }

    pub(crate) fn config(&self) -> &SessionConfig {
        &self.config
    }

    /// Ends the sessions past their idle TTL or maximum lifetime (those busy at their
    /// maximum lifetime once their call ended).
    fn expire(&self, now: Instant) {
        let mut st = lock(&self.state);
        // Sessions whose opening call went away before their runner was made (nobody holds
        // their lock, and they have no runner): they hold a name and a place in the caps.
        let abandoned: Vec<Key> = st
            .open
            .iter()
            .filter(|(_, s)| !s.runner.initialized() && s.busy.try_lock().is_ok())
            .map(|(k, _)| k.clone())
            .collect();
        for k in abandoned {
            if let Some(s) = st.open.remove(&k) {
                s.ended.cancel();
            }
        }
        // A session busy at its maximum lifetime ends after that call.
        let due: Vec<(Key, String)> = st
            .open
            .iter()
            .filter(|(_, s)| s.runner.initialized() && !s.running.load(Ordering::Acquire))
            .filter_map(|(k, s)| s.expired(now).map(|why| (k.clone(), why)))
            .collect();
        for (k, why) in due {
            let Some(s) = st.open.remove(&k) else {
                continue;
            };
            let e = ErrorBody::from(SessionError::Expired(why));
            Self::tombstone(&mut st, k, e.clone());
            self.finish(s, "expired", e);
        }
        st.tombstones
            .retain(|_, (_, since)| now.duration_since(*since) < TOMBSTONE_TTL);
    }

    fn tombstone(st: &mut State, key: Key, e: ErrorBody) {
        if st.tombstones.len() >= MAX_TOMBSTONES
            && let Some(oldest) = st
                .tombstones
                .iter()
                .min_by_key(|(_, (_, t))| *t)
                .map(|(k, _)| k.clone())
        {
            st.tombstones.remove(&oldest);
        }
        st.tombstones.insert(key, (e, Instant::now()));
    }

    /// Ends a session taken out of the map: kills its running call, then releases its
    /// runner in the background once the call let go.
    fn finish(&self, s: Arc<Session>, event: &'static str, why: ErrorBody) {
        *lock(&s.end_reason) = Some(why.clone());
        s.ended.cancel();
        let metrics = self.metrics.clone();
        tokio::spawn(async move {
            // The killed call reports its exit within the kill grace.
            let _ = tokio::time::timeout(Duration::from_secs(15), s.busy.lock()).await;
            if let Some(r) = s.runner.get() {
                match event {
                    "ended" => r.ending(None).await,
                    "expired" => r.ending(Some(why.message.clone())).await,
                    _ => {}
                }
                r.close().await;
                metrics.session(event);
                let context = lock(&s.context).clone();
                crate::audit::session(&s.who, &s.name, event, &s.profile, &context, &why.message);
            }
        });
    }

    /// Takes the session `name` of `caller` for one call of `spec`, opening it (a runner
    /// from the call's profile) when there is none. Waits while another call runs (within
    /// the call's timeout, reported on `progress`) unless `busy` says fail.
    pub(crate) async fn call(
        &self,
        executor: &dyn Executor,
        caller: &Caller,
        name: &str,
        spec: &ExecSpec,
        busy: SessionBusy,
        progress: &Progress,
    ) -> Result<SessionCall, ErrorBody> {
        // A call waits for a running one within its own timeout.
        let wait = spec.timeout;
        let key: Key = (caller.key(), name.to_owned());
        let profile = spec.profile.clone().unwrap_or_else(|| "default".into());
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if self.stop.is_cancelled() {
                return Err(SessionError::ShuttingDown.into());
            }
            let known = {
                let mut st = lock(&self.state);
                if let Some((e, _)) = st.tombstones.remove(&key) {
                    return Err(e);
                }
                st.open.contains_key(&key)
            };
            if !known && executor.sessions_shared() {
                // Opened by another replica (or by this one before a restart): its pod says.
                let (owner, hashed) = (label_hash(&[&key.0]), label_hash(&[&key.0, &key.1]));
                if let Some(found) = executor.find_kept(&owner, &hashed).await? {
                    self.adopt(&key, caller, found);
                }
            }
            let found = {
                let mut st = lock(&self.state);
                match st.open.get(&key) {
                    Some(s) => Ok(s.clone()),
                    None => Err(self.insert(&mut st, &key, caller, &profile)?),
                }
            };
            let s = match found {
                Ok(s) => s,
                Err((opened, guard)) => {
                    return self.open(executor, opened, guard, spec, progress).await;
                }
            };
            if s.profile != profile {
                return Err(SessionError::OtherProfile {
                    name: name.to_owned(),
                    has: s.profile.clone(),
                    asked: profile,
                }
                .into());
            }
            let guard = match s.busy.clone().try_lock_owned() {
                Ok(g) => g,
                Err(_) if busy == SessionBusy::Fail => {
                    return Err(SessionError::BusyFail(name.to_owned()).into());
                }
                Err(_) => {
                    progress.report(
                        Phase::Queued,
                        Some(format!(
                            "waiting for the running call of session {name:?} to end"
                        )),
                    );
                    tokio::select! {
                        g = s.busy.clone().lock_owned() => g,
                        _ = tokio::time::sleep_until(deadline) => {
                            return Err(SessionError::BusyTimeout {
                                name: name.to_owned(),
                                secs: wait.as_secs(),
                            }
                            .into());
                        }
                        _ = s.ended.cancelled() => continue,
                    }
                }
            };
            if s.ended.is_cancelled() {
                if let Some(e) = lock(&s.end_reason).clone() {
                    return Err(e);
                }
                continue;
            }
            let Some(runner) = s.runner.get().cloned() else {
                // Its opening failed or was abandoned (the opening call went away): it is
                // taken out of the map (if still there), and this call opens a new one.
                let mut st = lock(&self.state);
                if st.open.get(&key).is_some_and(|x| Arc::ptr_eq(x, &s)) {
                    st.open.remove(&key);
                }
                s.ended.cancel();
                continue;
            };
            if let Err(gone) = runner.check().await {
                let (e, event): (ErrorBody, _) = match gone {
                    Gone::Lost(reason) => (
                        SessionError::Lost {
                            name: name.to_owned(),
                            reason,
                        }
                        .into(),
                        "lost",
                    ),
                    Gone::Expired(why) => (SessionError::ExpiredElsewhere(why).into(), "gone"),
                    Gone::Ended => {
                        // Its owner ended it through another replica: the name is free.
                        let mut st = lock(&self.state);
                        if st.open.get(&key).is_some_and(|x| Arc::ptr_eq(x, &s)) {
                            st.open.remove(&key);
                        }
                        drop(st);
                        drop(guard);
                        self.finish(s, "gone", SessionError::EndedElsewhere.into());
                        continue;
                    }
                };
                {
                    let mut st = lock(&self.state);
                    if st.open.get(&key).is_some_and(|x| Arc::ptr_eq(x, &s)) {
                        st.open.remove(&key);
                    }
                }
                drop(guard);
                self.finish(s, event, e.clone());
                return Err(e);
            }
            // Across replicas: another one's call may hold the runner.
            let until = SystemTime::now() + spec.timeout + CALL_SLACK;
            let hold = runner
                .begin_call(until, busy == SessionBusy::Fail, deadline, progress)
                .await?;
            {
                // Under the map's lock, which the expiry holds while it looks at `running`:
                // a session is either still open and now busy, or ended before this call.
                let st = lock(&self.state);
                if !st.open.get(&key).is_some_and(|x| Arc::ptr_eq(x, &s)) {
                    drop(st);
                    if let Some(e) = lock(&s.end_reason).clone() {
                        return Err(e);
                    }
                    continue;
                }
                s.running.store(true, Ordering::Release);
            }
            let number = s.calls.fetch_add(1, Ordering::Relaxed) + 1;
            self.metrics.session_call();
            return Ok(SessionCall {
                session: s,
                runner,
                number,
                hold,
                _busy: guard,
            });
        }
    }

    /// Takes a session found on its runner's objects into this replica's map (unless one
    /// came meanwhile). Not counted against this replica's caps: it is open already.
    fn adopt(&self, key: &Key, caller: &Caller, found: FoundRunner) {
        let now = Instant::now();
        let age = SystemTime::now()
            .duration_since(found.opened)
            .unwrap_or_default();
        let opened = now.checked_sub(age).unwrap_or(now);
        let max_lifetime = found
            .expires_at
            .duration_since(found.opened)
            .unwrap_or_default();
        let runner = found.runner.clone();
        let context = runner.context();
        let profile = found.profile.clone();
        let s = Arc::new(Session {
            name: key.1.clone(),
            owner: key.0.clone(),
            who: caller.describe(),
            profile: found.profile,
            runner: tokio::sync::OnceCell::new_with(Some(runner.clone())),
            context: Mutex::new(context.clone()),
            opened,
            idle_ttl: found.idle_ttl,
            max_lifetime,
            last_used: Mutex::new(now),
            // At least the opening call ran (elsewhere); the count is this replica's.
            calls: AtomicU64::new(1),
            running: AtomicBool::new(false),
            busy: Arc::new(tokio::sync::Mutex::new(())),
            ended: self.stop.child_token(),
            end_reason: Mutex::new(None),
        });
        let mut st = lock(&self.state);
        if st.open.contains_key(key) {
            drop(st);
            // Another call of this replica took it meanwhile: this copy only stops watching.
            tokio::spawn(async move { drop(runner) });
            return;
        }
        st.open.insert(key.clone(), s);
        drop(st);
        self.metrics.session("adopted");
        crate::audit::session(
            &caller.describe(),
            &key.1,
            "adopted",
            &profile,
            &context,
            "session found on its pod (opened by another gateway replica)",
        );
    }

    /// Puts a new session in the map, its busy lock taken by the caller.
    fn insert(
        &self,
        st: &mut State,
        key: &Key,
        caller: &Caller,
        profile: &str,
    ) -> Result<(Arc<Session>, tokio::sync::OwnedMutexGuard<()>), ErrorBody> {
        let mine = st.open.keys().filter(|(o, _)| *o == key.0).count();
        if mine >= self.config.max_per_identity {
            return Err(SessionError::TooManyOfYours(mine).into());
        }
        if st.open.len() >= self.config.max_total {
            return Err(SessionError::TooMany(st.open.len()).into());
        }
        let (idle_ttl, max_lifetime) = self.config.lifetimes(profile);
        let now = Instant::now();
        let s = Arc::new(Session {
            name: key.1.clone(),
            owner: key.0.clone(),
            who: caller.describe(),
            profile: profile.to_owned(),
            runner: tokio::sync::OnceCell::new(),
            context: Mutex::new(RunContext::default()),
            opened: now,
            idle_ttl,
            max_lifetime,
            last_used: Mutex::new(now),
            calls: AtomicU64::new(0),
            running: AtomicBool::new(true),
            busy: Arc::new(tokio::sync::Mutex::new(())),
            ended: self.stop.child_token(),
            end_reason: Mutex::new(None),
        });
        let guard = s
            .busy
            .clone()
            .try_lock_owned()
            .map_err(|_| SessionError::Locked)?;
        st.open.insert(key.clone(), s.clone());
        Ok((s, guard))
    }

    /// Makes the runner of a session just inserted; on failure the session goes again.
    async fn open(
        &self,
        executor: &dyn Executor,
        s: Arc<Session>,
        guard: tokio::sync::OwnedMutexGuard<()>,
        spec: &ExecSpec,
        progress: &Progress,
    ) -> Result<SessionCall, ErrorBody> {
        let keep = KeepFor {
            owner: label_hash(&[&s.owner]),
            name: label_hash(&[&s.owner, &s.name]),
            expires_at: SystemTime::now() + s.max_lifetime,
            session: Some((s.name.clone(), s.idle_ttl)),
            first_call: spec.timeout + CALL_SLACK,
        };
        let opts = StartOptions {
            cancel: s.ended.child_token(),
            progress: progress.clone(),
            stdin: None,
        };
        let opened = executor.keep(spec, keep, opts).await;
        let runner = match opened {
            Ok(r) => r,
            Err(e) => {
                let mut st = lock(&self.state);
                let key = (s.owner.clone(), s.name.clone());
                if st.open.get(&key).is_some_and(|x| Arc::ptr_eq(x, &s)) {
                    st.open.remove(&key);
                }
                *lock(&s.end_reason) = Some(e.clone());
                s.ended.cancel();
                return Err(e);
            }
        };
        let context = runner.context();
        *lock(&s.context) = context.clone();
        // Checked before the runner is set: once it is, ending the session releases it
        // (`finish` waits for this call's lock, then closes what it finds).
        if s.ended.is_cancelled() {
            // Ended (by its owner, or the shutdown) while its runner was being made: nobody
            // else will release it.
            runner.close().await;
            let e = lock(&s.end_reason)
                .clone()
                .unwrap_or_else(|| SessionError::ShuttingDown.into());
            return Err(e);
        }
        let _ = s.runner.set(runner.clone());
        self.metrics.session("created");
        self.metrics.session_call();
        crate::audit::session(
            &s.who,
            &s.name,
            "opened",
            &s.profile,
            &context,
            "session opened",
        );
        s.calls.store(1, Ordering::Relaxed);
        // The pod was made held by this call: no API call.
        let until = SystemTime::now() + spec.timeout + CALL_SLACK;
        let deadline = tokio::time::Instant::now() + spec.timeout;
        let hold = runner
            .begin_call(until, false, deadline, progress)
            .await
            .unwrap_or_default();
        Ok(SessionCall {
            session: s,
            runner,
            number: 1,
            hold,
            _busy: guard,
        })
    }

    /// The open sessions of `caller`, by name: those of this replica, and when the
    /// backend's runners are shared (kube: the session pods), those every replica sees on
    /// them, so that any replica lists the same sessions.
    pub(crate) async fn list(
        &self,
        executor: &dyn Executor,
        caller: &Caller,
    ) -> Result<Vec<SessionInfo>, ErrorBody> {
        let owner = caller.key();
        let mut out: std::collections::BTreeMap<String, SessionInfo> = {
            let now = Instant::now();
            let st = lock(&self.state);
            st.open
                .iter()
                .filter(|((o, _), s)| *o == owner && s.runner.initialized())
                .map(|((_, name), s)| (name.clone(), s.info(now)))
                .collect()
        };
        if executor.sessions_shared() {
            let now = SystemTime::now();
            let since = |t: SystemTime| now.duration_since(t).unwrap_or_default();
            for k in executor.list_kept(&label_hash(&[&owner])).await? {
                if k.hash != label_hash(&[&owner, &k.name]) {
                    continue;
                }
                if let Some(here) = out.get_mut(&k.name) {
                    // Calls through other replicas count too.
                    here.calls = here.calls.max(k.calls);
                    here.busy |= k.busy;
                    continue;
                }
                let idle = if k.busy {
                    Duration::ZERO
                } else {
                    since(k.last_used.unwrap_or(k.opened))
                };
                let to_max = k.expires_at.duration_since(now).unwrap_or_default();
                let info = SessionInfo {
                    name: k.name.clone(),
                    profile: k.profile,
                    context: k.context,
                    age_secs: since(k.opened).as_secs(),
                    idle_secs: idle.as_secs(),
                    expires_in_secs: k.idle_ttl.saturating_sub(idle).min(to_max).as_secs(),
                    calls: k.calls,
                    busy: k.busy,
                };
                out.insert(k.name, info);
            }
        }
        Ok(out.into_values().collect())
    }

    /// Ends `caller`'s session `name`: its running call is killed, its runner released. A
    /// session another replica opened, when the backend's runners are shared (kube: its
    /// pod), is found on its runner's objects and taken over first, so any replica ends it.
    pub(crate) async fn end(
        &self,
        executor: &dyn Executor,
        caller: &Caller,
        name: &str,
    ) -> Result<(), ErrorBody> {
        let key: Key = (caller.key(), name.to_owned());
        let known = lock(&self.state).open.contains_key(&key);
        if !known && executor.sessions_shared() {
            let (owner, hashed) = (label_hash(&[&key.0]), label_hash(&[&key.0, &key.1]));
            if let Some(found) = executor.find_kept(&owner, &hashed).await? {
                self.adopt(&key, caller, found);
            }
        }
        let s = lock(&self.state).open.remove(&key);
        match s {
            Some(s) => {
                self.finish(s, "ended", SessionError::Ended(name.to_owned()).into());
                Ok(())
            }
            None => Err(SessionError::NoSuch(name.to_owned()).into()),
        }
    }

    /// At shutdown, after the running calls were killed: leaves each live session whose
    /// runner the other replicas reach to them (kube: its pod, see [`KeptRunner::leave`]),
    /// and releases the others' runners.
    pub(crate) async fn shutdown(&self) {
        let all: Vec<Arc<Session>> = lock(&self.state).open.drain().map(|(_, s)| s).collect();
        let closes = all.into_iter().map(|s| async move {
            s.ended.cancel();
            let _ = tokio::time::timeout(Duration::from_secs(15), s.busy.lock()).await;
            if let Some(r) = s.runner.get() {
                let context = lock(&s.context).clone();
                if r.leave().await {
                    self.metrics.session("left");
                    crate::audit::session(
                        &s.who,
                        &s.name,
                        "left",
                        &s.profile,
                        &context,
                        "the gateway shut down; the session lives on for its other replicas",
                    );
                    return;
                }
                r.close().await;
                self.metrics.session("ended");
                crate::audit::session(
                    &s.who,
                    &s.name,
                    "closed",
                    &s.profile,
                    &context,
                    "the gateway shut down",
                );
            }
        });
        futures_util::future::join_all(closes).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::ErrorCode;

    #[test]
    fn profile_lifetimes_stay_within_the_operator_s() {
        let mut c = SessionConfig::default();
        c.profiles.insert(
            "gpu".into(),
            ProfileLifetime {
                idle_ttl_secs: Some(60),
                max_lifetime_secs: None,
            },
        );
        c.validate().unwrap();
        assert_eq!(
            c.lifetimes("gpu"),
            (Duration::from_secs(60), Duration::from_secs(8 * 3600))
        );
        assert_eq!(c.lifetimes("other").0, Duration::from_secs(900));
        c.profiles.get_mut("gpu").unwrap().idle_ttl_secs = Some(901);
        assert!(c.validate().is_err());
    }

    /// A backend whose runner is made when the test says so, counting closes.
    struct Fake {
        gate: Arc<tokio::sync::Notify>,
        closed: Arc<AtomicU64>,
    }
    struct FakeRunner(Arc<AtomicU64>);
    impl KeptRunner for FakeRunner {
        fn context(&self) -> RunContext {
            RunContext::default()
        }
        fn start(
            &self,
            _: ExecSpec,
            _: StartOptions,
            _: bool,
        ) -> futures_util::future::BoxFuture<'_, Result<crate::exec::Execution, ErrorBody>>
        {
            Box::pin(async { Err(ErrorBody::new(ErrorCode::Internal, "not here")) })
        }
        fn check(&self) -> futures_util::future::BoxFuture<'_, Result<(), Gone>> {
            Box::pin(async { Ok(()) })
        }
        fn close(&self) -> futures_util::future::BoxFuture<'_, ()> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Box::pin(async {})
        }
    }
    impl Executor for Fake {
        fn name(&self) -> &'static str {
            "fake"
        }
        fn start(
            &self,
            _: ExecSpec,
            _: StartOptions,
        ) -> futures_util::future::BoxFuture<'_, Result<crate::exec::Execution, ErrorBody>>
        {
            Box::pin(async { Err(ErrorBody::new(ErrorCode::Internal, "not here")) })
        }
        fn keep(
            &self,
            _: &ExecSpec,
            _: KeepFor,
            _: StartOptions,
        ) -> futures_util::future::BoxFuture<'_, Result<Arc<dyn KeptRunner>, ErrorBody>> {
            Box::pin(async {
                self.gate.notified().await;
                Ok(Arc::new(FakeRunner(self.closed.clone())) as Arc<dyn KeptRunner>)
            })
        }
    }

    #[tokio::test]
    async fn a_session_ended_while_its_runner_is_made_releases_it() {
        let fake = Arc::new(Fake {
            gate: Arc::new(tokio::sync::Notify::new()),
            closed: Arc::new(AtomicU64::new(0)),
        });
        let sessions = Sessions::new(
            SessionConfig::default(),
            Metrics::default(),
            CancellationToken::new(),
        );
        let caller = Caller::local("test");
        let spec = ExecSpec {
            timeout: Duration::from_secs(5),
            ..ExecSpec::default()
        };
        let opening = {
            let (sessions, fake, caller, spec) =
                (sessions.clone(), fake.clone(), caller.clone(), spec.clone());
            tokio::spawn(async move {
                sessions
                    .call(
                        fake.as_ref(),
                        &caller,
                        "s",
                        &spec,
                        SessionBusy::Wait,
                        &Progress::default(),
                    )
                    .await
                    .map(|c| c.number())
            })
        };
        // Opening: not listed yet, but its owner can end it.
        while sessions.end(fake.as_ref(), &caller, "s").await.is_err() {
            tokio::task::yield_now().await;
        }
        assert!(
            sessions
                .list(fake.as_ref(), &caller)
                .await
                .unwrap()
                .is_empty()
        );
        fake.gate.notify_one();
        let e = opening.await.unwrap().unwrap_err();
        assert_eq!(e.code, ErrorCode::UnknownSession, "{e:?}");
        assert_eq!(fake.closed.load(Ordering::SeqCst), 1);
        // A call after that opens a new session, and a second caller's name is its own.
        fake.gate.notify_one();
        let n = sessions
            .call(
                fake.as_ref(),
                &caller,
                "s",
                &spec,
                SessionBusy::Wait,
                &Progress::default(),
            )
            .await
            .unwrap();
        assert_eq!(n.number(), 1);
        let busy = sessions
            .call(
                fake.as_ref(),
                &caller,
                "s",
                &spec,
                SessionBusy::Fail,
                &Progress::default(),
            )
            .await
            .err()
            .unwrap();
        assert_eq!(busy.code, ErrorCode::SessionBusy);
        drop(n);
        let again = sessions
            .call(
                fake.as_ref(),
                &caller,
                "s",
                &spec,
                SessionBusy::Fail,
                &Progress::default(),
            )
            .await
            .unwrap();
        assert_eq!(again.number(), 2);
        assert_eq!(
            sessions.list(fake.as_ref(), &caller).await.unwrap().len(),
            1
        );
        assert!(
            sessions
                .list(fake.as_ref(), &Caller::local("other"))
                .await
                .unwrap()
                .is_empty()
        );
    }

    #[tokio::test]
    async fn an_opening_abandoned_by_its_caller_does_not_hold_the_name() {
        let fake = Arc::new(Fake {
            gate: Arc::new(tokio::sync::Notify::new()),
            closed: Arc::new(AtomicU64::new(0)),
        });
        let sessions = Sessions::new(
            SessionConfig::default(),
            Metrics::default(),
            CancellationToken::new(),
        );
        let spec = ExecSpec {
            timeout: Duration::from_secs(5),
            ..ExecSpec::default()
        };
        let opening = {
            let (sessions, fake, spec) = (sessions.clone(), fake.clone(), spec.clone());
            tokio::spawn(async move {
                let caller = Caller::local("test");
                let _ = sessions
                    .call(
                        fake.as_ref(),
                        &caller,
                        "s",
                        &spec,
                        SessionBusy::Wait,
                        &Progress::default(),
                    )
                    .await;
            })
        };
        // Until the opening call holds the new session (waiting for its runner).
        while lock(&sessions.state).open.is_empty() {
            tokio::task::yield_now().await;
        }
        opening.abort();
        let _ = opening.await;
        fake.gate.notify_one();
        let call = tokio::time::timeout(
            Duration::from_secs(5),
            sessions.call(
                fake.as_ref(),
                &Caller::local("test"),
                "s",
                &spec,
                SessionBusy::Wait,
                &Progress::default(),
            ),
        )
        .await
        .expect("no endless retry")
        .unwrap();
        assert_eq!(call.number(), 1);
    }

    #[test]
    fn forwarded_names_are_per_caller_and_valid() {
        let a = Caller {
            identity: Some("a".into()),
            ..Caller::default()
        };
        let b = Caller {
            identity: Some("b".into()),
            ..Caller::default()
        };
        let long = "x".repeat(63);
        for n in ["build", long.as_str()] {
            let fa = forwarded_name(&a, n);
            assert_ne!(fa, forwarded_name(&b, n));
            crate::contract::check_session_name(&fa).unwrap();
        }
        assert_eq!(forwarded_name(&Caller::local("stdio"), "build"), "build");
    }
}
