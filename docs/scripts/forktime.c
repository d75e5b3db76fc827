/* forktime N: mallocs N MiB, fills it, then forks three times; each child checks one byte
 * and exits. Prints how long fork() took in the parent and how long the child took to
 * check and exit (docs/benchmarks.md, "fork without exec: what a fork costs"). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/wait.h>
#include <unistd.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec/1e9;}
int main(int argc,char**argv){size_t mb=atoi(argv[1]);char**c=malloc(mb*sizeof*c);
for(size_t i=0;i<mb;i++){c[i]=malloc(1<<20);memset(c[i],i|1,1<<20);}
for(int r=0;r<3;r++){double t0=now();pid_t p=fork();if(p==0)_exit((unsigned char)c[mb/2][7]==(unsigned char)((mb/2)|1)?0:1);double t1=now();int st;waitpid(p,&st,0);double t2=now();
printf("fork %zu MiB: fork() %.3f s, child check+exit %.3f s, status %d\n",mb,t1-t0,t2-t1,st);}return 0;}
