#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>
#include <sys/stat.h>
#include <sys/syscall.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e6+t.tv_nsec/1e3;}
int main(int c,char**v){int dir=open(v[1],O_PATH|O_DIRECTORY);char n[64],p[64];int N=20000;double t;
 t=now();for(int i=0;i<N;i++){sprintf(n,"a%d",i);mknodat(dir,n,S_IFREG|0644,0);int f=openat(dir,n,O_PATH|O_NOFOLLOW);struct stat st;fstat(f,&st);sprintf(p,"/proc/self/fd/%d",f);int r=open(p,O_RDWR);close(r);close(f);}printf("mknod+openpath+fstat+procopen %.2f us\n",(now()-t)/N);
 t=now();for(int i=0;i<N;i++){sprintf(n,"b%d",i);int f=openat(dir,n,O_CREAT|O_EXCL|O_RDWR|O_NOFOLLOW,0644);struct stat st;fstat(f,&st);int r=fcntl(f,F_GETFL);r=fcntl(f,F_DUPFD_CLOEXEC,0);close(r);close(f);}printf("creat+fstat+dup %.2f us\n",(now()-t)/N);
 int f=openat(dir,"a1",O_PATH);sprintf(p,"/proc/self/fd/%d",f);struct timespec ts[2]={{0,UTIME_OMIT},{1,0}};
 t=now();for(int i=0;i<N;i++){utimensat(AT_FDCWD,p,ts,0);}printf("utimensat proc %.2f us\n",(now()-t)/N);
 t=now();for(int i=0;i<N;i++){if(utimensat(f,"",ts,AT_EMPTY_PATH))perror("u");}printf("utimensat emptypath %.2f us\n",(now()-t)/N);
 t=now();for(int i=0;i<N;i++){chmod(p,0644);}printf("chmod proc %.2f us\n",(now()-t)/N);
 t=now();for(int i=0;i<N;i++){if(syscall(452,f,"",0644,AT_EMPTY_PATH))perror("c");}printf("fchmodat2 emptypath %.2f us\n",(now()-t)/N);
 t=now();for(int i=0;i<N;i++){int r=open(p,O_RDWR);close(r);}printf("proc open+close %.2f us\n",(now()-t)/N);
 return 0;}
