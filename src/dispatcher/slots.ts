// A counted set of slots, taken in the order asked for: a replica's calls in flight (WORKER_CONCURRENCY),
// and its claims (twice as many: src/dispatcher/dispatcher.ts), shared by every kind it carries out.
// Jobs fetched beyond the free claims wait here unclaimed, and claimed jobs beyond the free calls wait
// here with their lease. A share of another set (`within`) takes one of its own, then one of that set:
// those who take through it never hold more than its size of the other's.

/** Gives a slot back (once, however often it is called). Of a share, `releaseWithin` gives back only the
 * other set's slot, the share's kept until the release itself. */
export type Release = (() => void) & { releaseWithin?: () => void };

export class Slots {
  private free: number;
  private readonly waiting: (() => void)[] = [];
  private readonly within: Slots | undefined;

  constructor(size: number, within?: Slots) {
    this.free = size;
    this.within = within;
  }

  /** Resolves once a slot is this caller's, with the function that gives it back (once, however often
   * it is called). */
  take(): Promise<Release> {
    return this.request().taken;
  }

  /** Asks for a slot, as take() does; `cancel` withdraws the request, and gives back a slot it was
   * already given, so a caller that stops waiting leaves nothing queued behind. */
  request(): { taken: Promise<Release>; cancel(): void } {
    const own = this.requestOwn();
    if (!this.within) return own;
    const within = this.within;
    let inner: ReturnType<Slots['request']> | undefined;
    let cancelled = false;
    const taken = own.taken.then((releaseOwn) => {
      if (cancelled) return new Promise<Release>(() => {}); // own.cancel() gave it back
      inner = within.request();
      return inner.taken.then((releaseInner) =>
        Object.assign(() => {
          releaseInner();
          releaseOwn();
        }, { releaseWithin: releaseInner }),
      );
    });
    return {
      taken,
      cancel: () => {
        cancelled = true;
        inner?.cancel();
        own.cancel();
      },
    };
  }

  private requestOwn(): { taken: Promise<() => void>; cancel(): void } {
    let grant!: () => void;
    const taken = new Promise<void>((resolve) => (grant = resolve)).then(() => this.releaser());
    if (this.free > 0) {
      this.free--;
      grant();
    } else {
      this.waiting.push(grant);
    }
    return {
      taken,
      cancel: () => {
        const queued = this.waiting.indexOf(grant);
        if (queued >= 0) this.waiting.splice(queued, 1);
        else void taken.then((release) => release());
      },
    };
  }

  private releaser(): () => void {
    let held = true;
    return () => {
      if (held) this.release();
      held = false;
    };
  }

  private release(): void {
    const next = this.waiting.shift();
    if (next) next();
    else this.free++;
  }
}
