// A counted set of slots, taken in the order asked for: a replica's calls in flight (WORKER_CONCURRENCY),
// and its claims (twice as many: src/dispatcher/dispatcher.ts), shared by every kind it carries out.
// Jobs fetched beyond the free claims wait here unclaimed, and claimed jobs beyond the free calls wait
// here with their lease.
export class Slots {
  private free: number;
  private readonly waiting: (() => void)[] = [];

  constructor(size: number) {
    this.free = size;
  }

  /** Resolves once a slot is this caller's, with the function that gives it back (once, however often
   * it is called). */
  take(): Promise<() => void> {
    return this.request().taken;
  }

  /** Asks for a slot, as take() does; `cancel` withdraws the request, and gives back a slot it was
   * already given, so a caller that stops waiting leaves nothing queued behind. */
  request(): { taken: Promise<() => void>; cancel(): void } {
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
